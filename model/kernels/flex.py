"""The flex kernel: FlexAttention, with the mask as a block mask (blocks no query sees are skipped)
and the scheme's bias as a score modification, both fused in one compiled kernel.

`auto` picks it on CUDA for a score bias or a window while training or scoring whole sequences; it
is not picked for decoding (whose mask changes every step: SDPA with a one-row bias runs it). Block
masks are built eagerly in chunks of query tiles (`block_mask_in_chunks`), never as a whole Tq x Tk
mask.

It runs on CUDA only: asked for by name on a CPU it is refused at the forward pass, in one line
naming the kernels that can run (eager, sdpa), because compiled FlexAttention returns wrong numbers
on a CPU in torch 2.13 (issue 33; plain torch, no code of ours: `torch.compile(flex_attention)` with
a causal `create_block_mask`, against SDPA). What was measured there, over lengths 1-300:

- forward: wrong when the number of keys is 8 mod 16 (8, 24, 40, ... 120 seen; 0.03 off in the
  logits of a 2-layer model at 24 tokens, whole rows off by 1-3 in a bare call, NaN at times), and
  not deterministic: the same call is right in one process and wrong in the next, the wrong rows
  among the first queries of the tile, as if the kernel read memory it never wrote. Seen with head
  sizes 8 and 16, not in the same sweeps with 32 and 64 (so not ruled out). It is not the partial
  128-token tile: 13, 17, 100, 127, 129, 136 and 200 tokens are exact;
- decoding (one or five queries over the cache's keys): the same, at 8 keys;
- backward: none on a CPU, compiled or not (FlexAttention raises NotImplementedError).

Uncompiled `flex_attention` is exact on a CPU (its reference path forms the whole score matrix);
the tests run this kernel's block masks and score_mods through it there (`tests/helpers.py`
`uncompiled_flex`), and `posgpt check` runs the compiled kernel on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from model.kernels.base import Kernel, Needs, Step, WeightsHook
from model.kernels.dense import DENSE_ELEMENTS
from model.masks import AttentionMask
from model.positions import PositionEncoding
from model.scores import Score

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@functools.cache
def compiled_flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled once per process and shared by every layer and model.

    Compiling at first use (not at import) keeps `import model` cheap; without compilation
    flex_attention falls back to an unfused path that materializes the full score matrix.
    """
    return torch.compile(flex_attention)


def flex_attention_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask: BlockMask,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
) -> Tensor:
    """FlexAttention: the block mask and an optional score_mod (a position bias), fused in one kernel."""
    return compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)


def score_mod_of(pe: PositionEncoding, step: Step, offset: Tensor | int = 0) -> ScoreMod:
    """The scheme's bias as a FlexAttention score_mod: the same `relative_bias` as the dense path (of
    the heads numbered from `offset`: a layer's own, `pe.head_offset`)."""
    q_start, k_pos, ids, q_pos = step.q_start, step.k_pos, step.ids, step.q_pos
    if q_pos is not None and k_pos is not None:  # decoding: each row at its own positions

        def score_mod_rows(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            query = q_pos[b, q_idx]
            return score + pe.relative_bias(h + offset, query - k_pos[b, kv_idx], query)

        return score_mod_rows
    if ids is not None:

        def score_mod_ids(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            query = ids[b, q_idx]
            return score + pe.relative_bias(h + offset, query - ids[b, kv_idx], query)

        return score_mod_ids

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        query = q_idx + q_start
        return score + pe.relative_bias(h + offset, query - kv_idx, query)

    return score_mod


BLOCK = 128
"""FlexAttention's sparse block: a block mask says which BLOCK x BLOCK tiles of the scores to compute."""


@torch.compiler.disable  # built eagerly, also inside a compiled model: see `block_mask_in_chunks`
def build_block_mask(mask: AttentionMask, step: Step, cache: dict | None) -> BlockMask:
    """The block mask of `mask` for a forward pass, built once per shape and reused (in `cache`) by
    later forwards. Decoding through a cache (each row at its own positions, which change every
    step) builds a small one per step, per row."""
    q_start, q_len, device = step.q_start, step.q_len, step.device
    if step.q_pos is not None and step.k_pos is not None:
        q_pos, k_pos = step.q_pos, step.k_pos

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            k = k_pos[b, kv_idx]
            return mask.visible(q_pos[b, q_idx], k) & (k >= 0)

        return create_block_mask(mask_mod, q_pos.size(0), None, q_len, k_pos.size(-1), device=device)
    key = (mask, q_start, q_len, str(device))
    if cache is not None and key in cache:
        return cache[key]
    block_mask = block_mask_in_chunks(mask, q_start, q_len, q_start + q_len, device)
    if cache is not None:
        if len(cache) > 8:  # a handful of shapes per model (training, evaluation lengths)
            cache.clear()
        cache[key] = block_mask
    return block_mask


def block_mask_in_chunks(mask: AttentionMask, q_start: int, q_len: int, k_len: int, device: torch.device) -> BlockMask:
    """The block mask of queries at q_start.. over keys 0..k_len-1, as `create_block_mask` makes it
    (a tile is full when every pair in it is visible, partial when some are, and a tile past the
    end is never full), with the visibility formed a chunk of query tiles at a time (at most
    `DENSE_ELEMENTS` at once) and the tiles ordered by an eager sort. `create_block_mask` itself
    forms the whole Tq x Tk mask uncompiled (and int64 index grids with it: 8 GB at 32768 tokens)
    and compiled hits a Triton sort that compiles for minutes at 128 key tiles and more, that is
    from 16384 tokens on (pytorch/pytorch#182060, fixed after torch 2.11): the T=16384 step that
    never finished."""
    q_tiles, k_tiles = -(-q_len // BLOCK), -(-k_len // BLOCK)
    keys = torch.arange(k_tiles * BLOCK, device=device)
    chunk = max(1, DENSE_ELEMENTS // (BLOCK * BLOCK * k_tiles))  # query tiles at once
    partial, full = [], []
    for first in range(0, q_tiles, chunk):
        rows = torch.arange(first * BLOCK, min(first + chunk, q_tiles) * BLOCK, device=device)
        visible = mask.visible(rows[:, None] + q_start, keys[None, :])
        visible = visible & (rows < q_len)[:, None] & (keys < k_len)[None, :]
        seen = visible.view(-1, BLOCK, k_tiles, BLOCK).sum(dim=(1, 3))  # visible pairs per tile
        partial.append((seen > 0) & (seen < BLOCK * BLOCK))
        full.append(seen == BLOCK * BLOCK)
    return BlockMask.from_kv_blocks(
        *_ordered(torch.cat(partial)), *_ordered(torch.cat(full)), BLOCK_SIZE=BLOCK,
        mask_mod=mask.mask_mod(q_start), seq_lengths=(q_len, k_len),
    )  # fmt: skip


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """(query tiles, key tiles) bool -> how many key tiles each query tile has, and their indices
    first (the layout of `BlockMask.from_kv_blocks`), with batch and head dimensions of 1."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


@dataclass(frozen=True)
class FlexContext:
    block_mask: BlockMask
    score_mod: ScoreMod | None


class FlexKernel(Kernel):
    """Fused with a block-sparse mask and an in-kernel bias; no dropout; CUDA only (module docstring)."""

    score_bias = True
    bias_gradients = True
    devices = frozenset({"cuda"})
    device_notes = {"cpu": "compiled FlexAttention returns wrong numbers on a CPU in torch 2.13"}
    backward_devices = frozenset({"cuda"})
    auto_devices = frozenset({"cuda"})
    sparse_masks = True

    def rank(self, needs: Needs, device: torch.device) -> float:
        # first for a bias or a window on CUDA when the lengths repeat; after SDPA otherwise
        return 0.0 if (needs.score_bias or needs.sparse_mask) and not needs.decoding else 1.5

    def context(self, pe: PositionEncoding, mask: AttentionMask, step: Step, memo: dict, layer: int = 0) -> FlexContext:
        block_mask = build_block_mask(mask, step, memo)
        score_mod = score_mod_of(pe, step, pe.head_offset(layer)) if pe.score_bias else None
        return FlexContext(block_mask, score_mod)

    def run(
        self, q: Tensor, k: Tensor, v: Tensor, context: FlexContext, score: Score, dropout_p: float,
        on_weights: WeightsHook | None,
    ) -> Tensor:  # fmt: skip
        return flex_attention_fused(q, k, v, context.block_mask, context.score_mod, scale=score.scale)
