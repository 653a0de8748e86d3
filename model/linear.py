"""The model's linear layers, and which library multiplies their float32 matrices on a CPU.

On a CPU PyTorch runs a float32 `nn.Linear` through MKL's sgemm. MKL picks its AVX-512 kernels on
Intel processors only; on other x86 processors with AVX-512 (AMD Zen 4 and later) it runs its AVX2
kernels, at about two thirds of what the hardware does. oneDNN (bundled with PyTorch, and what
bf16 matmuls already use there) dispatches on the instruction set alone. `linear_backend`:

| value  | float32 on a CPU, eager                       | elsewhere (GPU, bf16, autocast, compiled) |
|--------|-----------------------------------------------|-------------------------------------------|
| aten   | `F.linear` (MKL)                              | `F.linear`                                |
| onednn | oneDNN's matmul, forward and backward         | `F.linear`                                |
| auto   | onednn on non-Intel x86 CPUs with AVX-512, else aten (`onednn_preferred`) | `F.linear` |

Measured on a 2-core AMD EPYC (Zen 4): the 6-layer, 384-wide model at batch 8 x 256 trains 1.14x
faster in float32 with oneDNN (BENCHMARKS.md, issue 22); the two agree to float32 rounding
(tests/test_linear.py). Under torch.compile the layers stay `F.linear`, which Inductor lowers itself.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LINEAR_BACKENDS = ("auto", "aten", "onednn")


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's linear operator (x86 and Arm CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_preferred() -> bool:
    """`auto`'s choice: oneDNN where MKL leaves AVX-512 unused (an x86 CPU with AVX-512 that is
    not Intel's), MKL everywhere else, including CPUs not measured (AVX2-only ones, Intel's)."""
    if not onednn_available() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else None
    return found is not None and found.group(1) != "GenuineIntel"


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias) for a 2-D x, by oneDNN (transposed views are read in place)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(torch.autograd.Function):
    """`F.linear` with its three matmuls (output, input gradient, weight gradient) run by oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))
        ctx.save_for_backward(x2, weight)
        ctx.input_shape, ctx.has_bias = x.shape, bias is not None
        return _onednn(x2, weight, bias).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.size(-1))
        grad_x = _onednn(g2, weight.t()).view(ctx.input_shape) if ctx.needs_input_grad[0] else None
        grad_w = _onednn(g2.t(), x2.t()) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state_dict) whose float32 CPU matmuls go where
    `backend` says (module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend: str = "auto") -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.onednn = backend == "onednn" or (backend == "auto" and onednn_preferred())

    def forward(self, x: Tensor) -> Tensor:
        if (
            self.onednn
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
        ):
            return OneDnnLinear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
