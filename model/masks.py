"""Which keys each query may see: one description per model, from which every kernel's mask and the
KV cache's eviction are derived.

A mask is composed of predicates in FlexAttention's `mask_mod` form, on absolute positions q (the
query) and k (the key):

    causal(q, k) = k <= q
    window(q, k) = q - k < W              (sliding window of W keys, the query's own included)
    sink(q, k)   = k < S                  (the first S tokens stay visible: StreamingLLM's sinks)

    visible(q, k) = causal and (window or sink)      with W > 0
    visible(q, k) = causal                           with W = 0 (full causal attention)

From this one description come: the flex `mask_mod` (a block mask, built once per forward and
shared by every layer), the dense boolean mask of eager and SDPA (`dense`), and what a KV cache
must keep (`kept_keys`): the sinks and the last W keys, which `model.cache` holds in S + W slots, so
that its memory stays constant however long decoding runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class AttentionMask:
    """Causal attention, optionally limited to a window of `window` keys plus `sinks` first keys."""

    window: int = 0
    """Keys each query sees, itself included (0: all earlier keys)."""
    sinks: int = 0
    """First keys that stay visible to every query beyond the window (needs window > 0)."""

    def __post_init__(self) -> None:
        if self.window < 0 or self.sinks < 0:
            raise ValueError(f"attn_window and attn_sinks must be >= 0, got {self.window} and {self.sinks}.")
        if self.sinks and not self.window:
            raise ValueError("attn_sinks keeps the first keys visible beyond a window: it needs attn_window > 0.")

    @property
    def causal_only(self) -> bool:
        """Plain causal attention: SDPA can run it as `is_causal=True` (FlashAttention on GPU)."""
        return self.window == 0

    def visible(self, q: Tensor, k: Tensor) -> Tensor:
        """Whether query position `q` sees key position `k` (broadcasting tensors of absolute positions)."""
        allowed = k <= q
        if self.window:
            allowed = allowed & ((q - k < self.window) | (k < self.sinks))
        return allowed

    def mask_mod(self, offset: int = 0) -> MaskMod:
        """The FlexAttention `mask_mod`, for queries whose indices start at absolute position `offset`
        and keys at 0."""

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self.visible(q_idx + offset, kv_idx)

        return mask_mod

    def dense(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """(Tq, Tk) bool, True where query at `q_pos[i]` sees key at `k_pos[j]`."""
        return self.visible(q_pos[:, None], k_pos[None, :])

    def seen_keys(self, q: Tensor) -> Tensor:
        """How many keys a query at position `q` sees (a tensor of positions, keys from 0): q + 1
        under causal attention; with a window its W keys plus the sinks before them."""
        n = q + 1
        if self.window:
            n = n.clamp(max=self.window) + (n - self.window).clamp(min=0, max=self.sinks)
        return n

    def kept_keys(self, length: int) -> int:
        """How many keys a cache holds at most after `length` tokens (all of them without a window)."""
        return min(length, self.window + self.sinks) if self.window else length
