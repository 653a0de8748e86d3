"""Which keys each query may see: one description per model, from which every kernel's mask and the
KV cache's eviction are derived.

A mask is composed of predicates in FlexAttention's `mask_mod` form, on absolute positions q (the
query) and k (the key):

    causal(q, k) = k <= q
    window(q, k) = q - k < W              (sliding window of W keys, the query's own included)
    sink(q, k)   = k < S                  (the first S tokens stay visible: StreamingLLM's sinks)
    random(q, k) = k // G in picks(q // G) (R random earlier blocks of G keys per block of queries)

    visible(q, k) = causal and (window or sink or random)      with W > 0
    visible(q, k) = causal                                     with W = 0 (full causal attention)

Window, sinks and random blocks together are BigBird's sparse attention (Zaheer et al. 2020), causal:
local, global (the first S tokens) and random attention. The R blocks of query block i (i >= 1) are
drawn from blocks 0..i-1 by an integer hash of (seed, i, draw): fixed by the seed, the same at every
length, pointwise (so that FlexAttention evaluates it inside its kernel), drawn with replacement
(two draws may pick one block).

From this one description come: the flex `mask_mod` (a block mask, built once per forward and
shared by every layer), the dense boolean mask of eager and SDPA (`dense`), and what a KV cache
must keep (`kept_keys`): the sinks and the last W keys, which `model.cache` holds in S + W slots, so
that its memory stays constant however long decoding runs (`rolling`); random blocks reach any
earlier key, so with them the cache keeps every key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from model.config import GPTConfig

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class AttentionMask:
    """Causal attention, optionally limited to a window of `window` keys plus `sinks` first keys."""

    window: int = 0
    """Keys each query sees, itself included (0: all earlier keys)."""
    sinks: int = 0
    """First keys that stay visible to every query beyond the window (needs window > 0)."""
    random_blocks: int = 0
    """Random earlier blocks of `block` keys each block of queries sees beyond the window (needs window > 0)."""
    sparse_block: int = 64
    """Size of the random blocks, in keys (and of the blocks of queries that draw them)."""
    random_seed: int = 0
    """Seed of the random blocks' draws."""

    def __post_init__(self) -> None:
        if self.window < 0 or self.sinks < 0 or self.random_blocks < 0 or self.sparse_block < 1:
            raise ValueError(
                f"attn_window, attn_sinks and attn_random_blocks must be >= 0 and attn_sparse_block >= 1, got "
                f"{self.window}, {self.sinks}, {self.random_blocks} and {self.sparse_block}."
            )
        if (self.sinks or self.random_blocks) and not self.window:
            raise ValueError("attn_sinks and attn_random_blocks add keys beyond a window: they need attn_window > 0.")

    @classmethod
    def of(cls, config: GPTConfig) -> AttentionMask:
        """The mask a model of `config` attends with."""
        return cls(config.attn_window, config.attn_sinks, config.attn_random_blocks, config.attn_sparse_block,
                   config.attn_random_seed)  # fmt: skip

    @property
    def causal_only(self) -> bool:
        """Plain causal attention: SDPA can run it as `is_causal=True` (FlashAttention on GPU)."""
        return self.window == 0

    @property
    def rolling(self) -> bool:
        """Whether a decoding cache may drop keys: a window with no random blocks keeps S + W."""
        return self.window > 0 and self.random_blocks == 0

    def visible(self, q: Tensor, k: Tensor) -> Tensor:
        """Whether query position `q` sees key position `k` (broadcasting tensors of absolute positions)."""
        allowed = k <= q
        if self.window:
            local = (q - k < self.window) | (k < self.sinks)
            for draw in range(self.random_blocks):
                local = local | (k // self.sparse_block == self.pick(q // self.sparse_block, draw))
            allowed = allowed & local
        return allowed

    def pick(self, query_block: Tensor, draw: int) -> Tensor:
        """The key block that `draw` picks for each query block i: hash(seed, i, draw) mod i, in
        0..i-1 (-1 for block 0, which has no earlier block). Integer arithmetic in int64 that stays below
        2^63 (compiled flex on CUDA hands its mask_mod int32 indices: widened first)."""
        if query_block.dtype != torch.int64:  # (a no-op cast trips inductor's CPU flex code in dynamic shapes)
            query_block = query_block.long()
        x = (query_block * 40503 + draw * 2047 + self.random_seed * 92821 + 12345) % (1 << 32)
        for _ in range(2):  # a 32-bit integer mix (xor-shift, multiply)
            x = ((x ^ (x >> 16)) * 0x45D9F3B) % (1 << 32)
        x = x ^ (x >> 16)
        return torch.where(query_block > 0, x % query_block.clamp(min=1), -1)

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
        under causal attention; with a window its W keys plus the sinks before them, plus the keys of
        each distinct random block that neither holds. Pointwise (a flex score_mod calls it)."""
        n = q + 1
        if not self.window:
            return n
        if q.dtype != torch.int64:  # int64 arithmetic, whatever the caller's index type
            q, n = q.long(), n.long()
        start = (q - self.window + 1).clamp(min=0)  # the window is keys start..q
        seen = n.clamp(max=self.window) + start.clamp(max=self.sinks)
        picks = [self.pick(q // self.sparse_block, draw) for draw in range(self.random_blocks)]
        for draw, block in enumerate(picks):
            new = block >= 0
            for earlier in picks[:draw]:
                new = new & (block != earlier)
            size = self.sparse_block
            first, end = block * size, (block + 1) * size  # keys first..end-1, all before q
            in_window = (end - torch.maximum(first, start)).clamp(min=0)
            in_sinks = (end.clamp(max=self.sinks) - first).clamp(min=0)
            in_both = (end.clamp(max=self.sinks) - torch.maximum(first, start)).clamp(min=0)
            seen = seen + torch.where(new, size - in_window - in_sinks + in_both, 0)
        return seen

    def kept_keys(self, length: int) -> int:
        """How many keys a cache holds at most after `length` tokens (all of them unless `rolling`)."""
        return min(length, self.window + self.sinks) if self.rolling else length

    def attended_keys(self, length: int) -> int:
        """How many keys a query attends to at most in a sequence of `length` (the FLOP count's)."""
        if not self.window:
            return length
        return min(length, self.window + self.sinks + self.random_blocks * self.sparse_block)
