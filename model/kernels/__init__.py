"""Softmax attention's kernels and their registry: eager (the reference), SDPA and FlexAttention.

What `attn_backend="auto"` picks (each kernel's declared capabilities and `rank`):

| needs                                                   | CUDA                                  | CPU / other |
|---------------------------------------------------------|---------------------------------------|-------------|
| nothing beyond causal (learned, sinusoidal, rope, none) | sdpa, is_causal=True (FlashAttention) | sdpa        |
| a score bias (alibi, t5) or a window mask               | flex (bias, block sparsity in-kernel) | sdpa        |
| the same, with attention dropout or when decoding       | sdpa (no dropout in flex; no per-length compile) | sdpa |
| the additive score                                      | eager (chunked over queries)          | eager       |
"""

from posgpt.model.kernels.base import AUTO, Kernel, KernelError, Lack, Needs, Placement, Plan, WeightsHook
from posgpt.model.kernels.dense import DenseContext, causal_mask
from posgpt.model.kernels.eager import EagerKernel, SoftmaxEager, eager_attention
from posgpt.model.kernels.flex import FlexKernel, compiled_flex_attention
from posgpt.model.kernels.sdpa import SdpaKernel, sdpa_attention

KERNELS: dict[str, Kernel] = {"eager": SoftmaxEager(), "sdpa": SdpaKernel(), "flex": FlexKernel()}
"""Softmax attention's kernels by `attn_backend` name."""

__all__ = [
    "AUTO", "KERNELS", "DenseContext", "EagerKernel", "FlexKernel", "Kernel", "KernelError", "Lack", "Needs",
    "Placement", "Plan", "SdpaKernel", "SoftmaxEager", "WeightsHook", "causal_mask", "compiled_flex_attention",
    "eager_attention", "sdpa_attention",
]  # fmt: skip
