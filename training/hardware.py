"""What the hardware decides: the precision `auto` picks, the peak FLOP/s behind MFU, the accelerators it has, and
FP8 training of the blocks' linear layers (`train.fp8`) through torchao's `Float8Linear`: weights keep their dtype
and names, each matmul casts to FP8 with a dynamic per-tensor scale; the tied output layer stays bf16."""

from __future__ import annotations

import torch
from torch import nn

from posgpt.core.device import DeviceError, auto_dtype

DENSE_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("h200 nvl", 835.5e12),
    ("h200", 989.4e12),
    ("h100 nvl", 835.5e12),
    ("h100 pcie", 756.0e12),
    ("h100", 989.4e12),  # "NVIDIA H100 80GB HBM3", the SXM part
    ("a100", 312.0e12),
)
"""Dense bf16 / fp16 peaks from NVIDIA's datasheets, first match of the lower-cased name (TF32: half); Lightning's
table, the fallback, lists some with sparsity, or not at all."""


def uses_cuda(accelerator: str) -> bool:
    """Whether Lightning's accelerator setting ends up on a CUDA GPU here."""
    return accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def resolve_precision(precision: str, accelerator: str) -> str:
    """'auto' -> the fastest precision that trains correctly here (`core.device.auto_dtype`'s rule, the table of
    docs/training.md); anything else as given."""
    if precision != "auto":
        return precision
    if not uses_cuda(accelerator) and accelerator not in ("auto", "cpu"):
        return "32-true"
    dtype = auto_dtype("cuda" if uses_cuda(accelerator) else "cpu", training=True)
    return {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(dtype, "32-true")


def check_hardware(accelerator: str) -> None:
    """Refuse, with the fix, an accelerator this machine lacks."""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise DeviceError(
            f"--train.accelerator {accelerator}: no CUDA GPU is available here. Use --train.accelerator auto or cpu."
        )
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("--train.accelerator mps: MPS is not available here. Use --train.accelerator auto or cpu.")


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak FLOP/s for the matmuls of `precision`, or None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    half = "bf16" in precision or precision.startswith("16")
    for chip, bf16_peak in DENSE_BF16_PEAKS:
        if chip in name:
            return bf16_peak if half else bf16_peak / 2  # float32 runs as TF32 (set in training.run)
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if half else "tfloat32"
    peak = get_available_flops(device, dtype)
    return float(peak) if peak else None


def check_fp8(accelerator: str, precision: str, option: str = "--train.fp8") -> None:
    """Refuse `train.fp8` where it cannot run, with the fix; `option` is how the command spells the flag."""
    if not uses_cuda(accelerator):
        raise DeviceError(
            f"{option} true needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: H100, H200, "
            f"L4, RTX 4090) and none is used here. Leave {option} false."
        )
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):  # the first CUDA compute capability with FP8 tensor cores (Ada Lovelace)
        name = torch.cuda.get_device_name()
        raise DeviceError(
            f"{option} true needs FP8 tensor cores (compute capability 8.9+: H100, H200, L4, RTX 4090); "
            f"{name} has {capability[0]}.{capability[1]}. Leave {option} false (bf16 is this GPU's fastest)."
        )
    if precision not in ("bf16-mixed", "bf16-true"):
        raise DeviceError(
            f"{option} true trains with bf16 around the FP8 matmuls, not --train.precision {precision}. "
            "Use --train.precision bf16-mixed (or auto)."
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise DeviceError(f"{option} true needs torchao: pip install torchao (or leave {option} false).") from None


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """Whether the layer `name` trains in FP8: a block's linear layer with sizes multiples of 16."""
    if not isinstance(module, nn.Linear) or not name.startswith("blocks."):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model: nn.Module) -> int:
    """Swap the eligible linear layers of `model` for Float8Linear in place, before compiling; returns how many."""
    from torchao.float8 import convert_to_float8_training

    names = [name for name, module in model.named_modules() if fp8_eligible(module, name)]
    convert_to_float8_training(model, module_filter_fn=fp8_eligible)
    return len(names)
