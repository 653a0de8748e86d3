"""Which kernel multiplies a linear layer's float32 matrices when a CPU decodes: a property of the machine, chosen
at run time (`onednn_linears`, called by the sampler's and the decode benchmark's set-up), never a model setting.

PyTorch runs a float32 `nn.Linear` on a CPU through MKL's sgemm, which takes its AVX-512 kernels on Intel
processors only: on other x86 processors with AVX-512 (AMD Zen 4 and later) it runs its AVX2 ones. oneDNN, bundled
with PyTorch, dispatches on the instruction set alone, in one op where `F.linear` of a batch of vectors takes three
(`t`, `mm`, `_unsafe_view`). Eager decoding on a 2-core Zen 4 ran 1.39-1.46x Hugging Face's `generate` with
oneDNN's layers and 0.96-1.01x without (BENCHMARKS.md, issue 50). The two agree to float32 rounding, in another
summation order: a sampled token can differ where two logits are within rounding of each other.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn


def onednn_preferred() -> bool:
    """oneDNN where MKL leaves AVX-512 unused (an x86 CPU with AVX-512 that is not Intel's); MKL everywhere else,
    including the CPUs not measured (AVX2-only ones, Intel's)."""
    if not torch.backends.mkldnn.is_available() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else None
    return found is not None and found.group(1) != "GenuineIntel"


class OneDnnLinear(nn.Linear):
    """`nn.Linear` (the same parameters and state_dict) whose float32 CPU forward without gradients is oneDNN's
    matmul; anything else (a gradient, another dtype or device, a compiled graph) is `F.linear`'s."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32 or not x.is_cpu or torch.compiler.is_compiling():
            return super().forward(x)
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def onednn_linears(model: nn.Module) -> bool:
    """Run `model`'s linear layers through oneDNN when it decodes on this machine's CPU, where `onednn_preferred`;
    whether it does."""
    if not onednn_preferred() or not next(model.parameters()).is_cpu:
        return False
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
    return True
