"""The attention layers, one module per attention function, and their registry `ATTENTIONS`.

A layer projects, applies the position scheme and hands q, k, v to the forward pass's `Plan`, never
asking which kernel it has; its class declares what the function is (see docs/extending.md).
"""

from posgpt.model.attention.base import QK_NORMS, Attention
from posgpt.model.attention.delta import GatedDeltaNet, KimiDeltaAttention
from posgpt.model.attention.differential import DifferentialAttention
from posgpt.model.attention.forgetting import ForgettingAttention
from posgpt.model.attention.linear import LinearAttention
from posgpt.model.attention.sigmoid import SigmoidAttention
from posgpt.model.attention.softmax import SoftmaxAttention
from posgpt.model.attention.stick_breaking import StickBreakingAttention

ATTENTIONS: dict[str, type[Attention]] = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "sigmoid": SigmoidAttention,
    "differential": DifferentialAttention,
    "stick_breaking": StickBreakingAttention,
    "forgetting": ForgettingAttention,
    "gated_deltanet": GatedDeltaNet,
    "kda": KimiDeltaAttention,
}
"""The attention functions by `attention` name: each a layer class with its own kernels."""

__all__ = ["ATTENTIONS", "QK_NORMS", "Attention", "DifferentialAttention", "ForgettingAttention", "GatedDeltaNet",
           "KimiDeltaAttention", "LinearAttention", "SigmoidAttention", "SoftmaxAttention",
           "StickBreakingAttention"]  # fmt: skip
