"""Where and in what precision a model runs, for training, sampling and evaluation alike.

`auto_dtype` is the one rule; training turns its answer into a Lightning precision
(`training.hardware.resolve_precision`), sampling and evaluation into an autocast dtype
(`pick_device_dtype`).
"""

from __future__ import annotations

import torch

from core.errors import UserError


class DeviceError(UserError, ValueError):
    """A device or precision this machine cannot run; the message names what it can."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16, Arm BF16),
    which oneDNN uses for bf16 matmuls. Without them `auto` keeps float32 (bf16 was not measured there)."""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("bf16") or caps.get("sve_bf16"))


def auto_dtype(device_type: str, training: bool) -> torch.dtype:
    """The precision `auto` means on a device of `device_type`:

    | where                                 | training                  | sampling, evaluation |
    |---------------------------------------|---------------------------|----------------------|
    | CUDA GPU with bf16 (Ampere and later) | bfloat16                  | bfloat16             |
    | older CUDA GPU                        | float16 (with loss scale) | float16              |
    | CPU with bf16 instructions            | bfloat16 (1.3-2x float32) | float32              |
    | any other CPU, MPS                    | float32                   | float32              |

    On a CPU, bf16 pays in training, where large matmuls dominate (BENCHMARKS.md, "bf16 on the
    CPU"); evaluation keeps float32 there, the reference precision of the numbers it reports, and
    sampling too, whose one-token steps are too small to gain.
    """
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device_type == "cpu" and training and cpu_has_bf16_matmul():
        return torch.bfloat16
    return torch.float32


def pick_device(device: str) -> torch.device:
    """'auto' is CUDA when present, else the CPU; anything else must exist here."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"--device {device}: not a device; use auto, cpu, cuda or cuda:N.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device}: CUDA is not available here; use --device cpu or auto.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    elif dev.type != "cpu":
        raise DeviceError(f"--device {device}: only cpu and cuda are supported here; use --device cpu or auto.")
    return dev


def pick_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """The device and the dtype to run a loaded checkpoint in, for sampling and evaluation."""
    dev = pick_device(device)
    if dtype == "auto":
        return dev, auto_dtype(dev.type, training=False)
    if dtype not in DTYPES:
        raise DeviceError(f"--dtype {dtype}: choose among auto, {', '.join(DTYPES)}.")
    return dev, DTYPES[dtype]
