"""FP8 training of the blocks' linear layers (`train.fp8`) through torchao's `Float8Linear`: weights keep their
dtype and names, each matmul casts to FP8 with a dynamic per-tensor scale; the tied output layer stays bf16."""

from __future__ import annotations

import torch
from torch import nn

from training.hardware import HardwareError, uses_cuda

FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with FP8 tensor cores (Ada Lovelace)


def check_fp8(accelerator: str, precision: str, option: str = "--train.fp8") -> None:
    """Refuse `train.fp8` where it cannot run, with the fix; `option` is how the command spells the flag."""
    if not uses_cuda(accelerator):
        raise HardwareError(
            f"{option} true needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: H100, H200, "
            f"L4, RTX 4090) and none is used here. Leave {option} false."
        )
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise HardwareError(
            f"{option} true needs FP8 tensor cores (compute capability 8.9+: H100, H200, L4, RTX 4090); "
            f"{name} has {capability[0]}.{capability[1]}. Leave {option} false (bf16 is this GPU's fastest)."
        )
    if precision not in ("bf16-mixed", "bf16-true"):
        raise HardwareError(
            f"{option} true trains with bf16 around the FP8 matmuls, not --train.precision {precision}. "
            "Use --train.precision bf16-mixed (or auto)."
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        message = f"{option} true needs torchao: pip install torchao (or leave {option} false)."
        raise HardwareError(message) from None


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """Whether the layer `name` trains in FP8: a block's linear layer with sizes multiples of 16."""
    return (
        isinstance(module, nn.Linear)
        and name.startswith("blocks.")
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_to_fp8(model: nn.Module) -> int:
    """Swap the eligible linear layers of `model` for Float8Linear in place, before compiling; returns how many."""
    from torchao.float8 import convert_to_float8_training

    names = [name for name, module in model.named_modules() if fp8_eligible(module, name)]
    convert_to_float8_training(model, module_filter_fn=fp8_eligible)
    return len(names)
