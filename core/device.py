"""Where and in what precision a model runs, for training, sampling and evaluation alike (`auto_dtype`)."""

from __future__ import annotations

import torch

from posgpt.core.errors import UserError


class DeviceError(UserError, ValueError):
    """A device or precision this machine cannot run; the message names what it can."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_dtype(device_type: str, training: bool) -> torch.dtype:
    """The precision `auto` means on a device of `device_type`: bf16 on a CUDA GPU that has it, else float16;
    on a CPU with bf16 instructions bf16 for training only (large matmuls gain, BENCHMARKS.md; evaluation keeps
    its reference float32, sampling's one-token steps are too small to gain); float32 elsewhere."""
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device_type == "cpu" and training:  # with the bf16 dot-product instructions oneDNN's bf16 matmuls use
        caps = torch.cpu.get_capabilities()
        if caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("bf16") or caps.get("sve_bf16"):
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
    dev = pick_device(device)  # every --dtype is typed Literal["auto", *DTYPES]: the parser refuses any other
    return dev, auto_dtype(dev.type, training=False) if dtype == "auto" else DTYPES[dtype]
