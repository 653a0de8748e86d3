"""Which keys each query may see: one description per model, from which every kernel's mask and the
KV cache's eviction are derived.

A mask is composed of predicates in FlexAttention's `mask_mod` form, on absolute positions q (the
query) and k (the key):

    causal(q, k) = k <= q
    window(q, k) = q - k < W              (sliding window of W keys, the query's own included)
    sink(q, k)   = k < S                  (the first S tokens stay visible: StreamingLLM's sinks)
    random(q, k) = k // G in picks(q // G) (R random blocks of G keys per block of queries)
    chunk(q, k)  = q // C == k // C       (chunked local attention: Llama 4's, the query's chunk of C)

    visible(q, k) = causal and (window or sink or random)      with W > 0
    visible(q, k) = causal and chunk                           with C > 0
    visible(q, k) = causal                                     with W = C = 0 (full causal attention)

Window, sinks and random blocks are BigBird's sparse attention (Zaheer et al. 2020), causal. As
BigBird's `get_single_block_row_attention` (google-research/bigbird), query block i draws R distinct
key blocks j that hold no sink token (j G >= S) and end before its first query's window
((j + 1) G <= i G - W + 1), all of them when fewer: sampling without replacement, each draw an integer
hash of (seed, i, draw), so fixed by the seed, the same at every length and pointwise (FlexAttention
evaluates it inside its kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


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
    random_draw: str = "bigbird"
    """How the random blocks are drawn (`GPTConfig.attn_random_draw`)."""
    chunk: int = 0
    """Chunked local attention: keys each query sees are those of its chunk of `chunk` positions (0: off)."""

    @classmethod
    def of(cls, config: GPTConfig) -> AttentionMask:
        return cls(config.attn_window, config.attn_sinks, config.attn_random_blocks, config.attn_sparse_block,
                   config.attn_random_seed, config.attn_random_draw, config.attn_chunk)  # fmt: skip

    @property
    def causal_only(self) -> bool:
        """Plain causal attention: SDPA can run it as `is_causal=True` (FlashAttention on GPU)."""
        return self.window == 0 and self.chunk == 0

    @property
    def window_only(self) -> bool:
        """A sliding window and nothing else beyond causal (no sinks, random blocks or chunks)."""
        return self.window > 0 and not (self.sinks or self.random_blocks or self.chunk)

    @property
    def rolling(self) -> bool:
        """Whether a decoding cache may drop keys: a window with no random blocks keeps S + W, a chunk C."""
        return (self.window > 0 and self.random_blocks == 0) or self.chunk > 0

    @property
    def ring(self) -> int:
        """The keys a rolling cache cycles through after the sinks: the window, or the chunk."""
        return self.window or self.chunk

    def visible(self, q: Tensor, k: Tensor) -> Tensor:
        """Whether query position `q` sees key position `k` (broadcasting tensors of absolute positions)."""
        allowed = k <= q
        if self.chunk:
            allowed = allowed & (q // self.chunk == k // self.chunk)
        if self.window:
            local = (q - k < self.window) | (k < self.sinks)
            key_block = k // self.sparse_block
            for block in self.picks(q // self.sparse_block):
                local = local | (key_block == block)
            allowed = allowed & local
        return allowed

    def picks(self, query_block: Tensor) -> list[Tensor]:
        """The key blocks each query block draws, one tensor per draw shaped like `query_block`, -1
        where a draw picks nothing (too few eligible blocks, or the first block)."""
        if not self.random_blocks:
            return []
        if query_block.dtype != torch.int64:  # (a no-op cast trips inductor's CPU flex code in dynamic shapes)
            query_block = query_block.long()
        if self.random_draw == "earlier_with_replacement":  # the older draw: hash(seed, i, draw) mod i, in 0..i-1
            earlier = query_block.clamp(min=1)
            draws = (self._hash(query_block, draw) % earlier for draw in range(self.random_blocks))
            return [torch.where(query_block > 0, block, -1) for block in draws]
        # min(R, count) distinct blocks of the eligible range: draw r is uniform among the count - r blocks not yet
        # taken (the r-th hash modulo count - r, then moved past each earlier pick at or below it, in ascending
        # order), so no block is drawn twice; pointwise, R^2 comparisons. The key blocks lo..lo + count - 1 that
        # query block i may draw under BigBird's rule: no sink token in them, and wholly before the window of the
        # block's first query
        lo = -(-self.sinks // self.sparse_block)  # the first block free of sinks
        hi = torch.div(query_block * self.sparse_block - self.window + 1, self.sparse_block, rounding_mode="floor")
        count = (hi - lo).clamp(min=0)
        taken: list[Tensor] = []  # earlier picks (offsets in the range), ascending
        picks = []
        for draw in range(self.random_blocks):
            left = count - draw
            x = self._hash(query_block, draw) % left.clamp(min=1)
            for earlier in taken:  # the x-th block not yet taken
                x = x + (x >= earlier).long()
            picks.append(torch.where(left > 0, lo + x, -1))
            sorted_taken = []
            for earlier in taken:  # insert x, keeping the list ascending
                sorted_taken.append(torch.minimum(earlier, x))
                x = torch.maximum(earlier, x)
            taken = [*sorted_taken, x]
        return picks

    def _hash(self, query_block: Tensor, draw: int) -> Tensor:
        """A 32-bit integer mix (xor-shift, multiply) of (seed, i, draw), in int64 arithmetic that stays
        below 2^63 (compiled flex on CUDA hands its mask_mod int32 indices: widened by `picks`)."""
        x = (query_block * 40503 + draw * 2047 + self.random_seed * 92821 + 12345) % (1 << 32)
        for _ in range(2):
            x = ((x ^ (x >> 16)) * 0x45D9F3B) % (1 << 32)
        return x ^ (x >> 16)

    def dense(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """(Tq, Tk) bool, True where query at `q_pos[i]` sees key at `k_pos[j]`."""
        return self.visible(q_pos[:, None], k_pos[None, :])

    def seen_keys(self, q: Tensor) -> Tensor:
        """How many keys a query at position `q` sees (a tensor of positions): the window, the sinks before
        it and each distinct random block's keys that neither holds. Pointwise (a flex score_mod calls it)."""
        if self.chunk:
            return torch.remainder(q, self.chunk) + 1
        if not self.window:
            return q + 1
        if q.dtype != torch.int64:  # int64 arithmetic, whatever the caller's index type
            q = q.long()
        start = (q - self.window + 1).clamp(min=0)  # the window is keys start..q
        seen = (q + 1).clamp(max=self.window) + start.clamp(max=self.sinks)
        picks = self.picks(q // self.sparse_block)
        if self.random_draw == "bigbird":  # distinct blocks, clear of the window and the sinks
            return seen + sum((block >= 0).long() for block in picks) * self.sparse_block
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

    def attended_keys(self, length: int) -> int:
        """How many keys a query attends to at most in a sequence of `length` (the FLOP count's)."""
        if self.chunk:
            return min(length, self.chunk)
        if not self.window:
            return length
        return min(length, self.window + self.sinks + self.random_blocks * self.sparse_block)
