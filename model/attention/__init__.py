"""The attention layers, one module per attention function (softmax, linear with its state cache,
sigmoid, differential), and their registry `ATTENTIONS`.

A layer projects its input to queries, keys and values, applies the position scheme, and hands
them to the forward pass's `Plan` (a kernel and the context it built once for every layer); it
never asks which kernel it has. The layer class also declares what the function is: its kernels
(each function has its own registry of them), whether attention dropout and a scoring function
apply to it, what decoding keeps (`new_cache`) and whether that stays the same size however long
decoding runs (`constant_memory`). Adding an attention function is one layer class (usually with a
kernel class of its own) and one line in `ATTENTIONS`: see docs/extending.md. What the registries
allow together is checked in `model.validation`.
"""

from __future__ import annotations

from model.attention.base import Attention
from model.attention.differential import DifferentialAttention
from model.attention.linear import LinearAttention, StateCache
from model.attention.sigmoid import SigmoidAttention
from model.attention.softmax import SoftmaxAttention
from model.cache import KVCache

Cache = KVCache | StateCache
"""What decoding keeps: keys and values (softmax and its kin), or linear attention's running sums."""

ATTENTIONS: dict[str, type[Attention]] = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "sigmoid": SigmoidAttention,
    "differential": DifferentialAttention,
}
"""The attention functions by `attention` name: each a layer class with its own kernels."""

__all__ = ["ATTENTIONS", "Attention", "Cache", "DifferentialAttention", "LinearAttention", "SigmoidAttention",
           "SoftmaxAttention"]  # fmt: skip
