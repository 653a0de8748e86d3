"""FlexAttention's block masks, built eagerly (also inside a compiled model) a chunk of query tiles at a
time: never the whole Tq x Tk mask (`block_mask_in_chunks`).

Importing this module imports Dynamo (`torch.compiler.disable`); model/kernels/flex.py imports it at
the first forward pass that needs a block mask, so that `import model` stays cheap.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from model.kernels.base import Step
from model.kernels.dense import DENSE_ELEMENTS
from model.masks import AttentionMask

BLOCK = 128
"""FlexAttention's sparse block: a block mask says which BLOCK x BLOCK tiles of the scores to compute."""


@torch.compiler.disable  # built eagerly, also inside a compiled model: see `block_mask_in_chunks`
def eager_block_mask(mask: AttentionMask, step: Step, cache: dict | None) -> BlockMask:
    """The block mask of `mask` for a forward pass, built once per shape and reused (in `cache`) by
    later forwards. Decoding through a cache (each row at its own positions, which change every
    step) builds a small one per step, per row."""
    q_len, device = step.q_len, step.device
    if step.k_pos is not None:
        q_pos, k_pos = step.positions, step.k_pos

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            k = k_pos[b, kv_idx]
            return mask.visible(q_pos[b, q_idx], k) & (k >= 0)

        return create_block_mask(mask_mod, q_pos.size(0), None, q_len, k_pos.size(-1), device=device)
    key = (mask, q_len, str(device))
    if cache is not None and key in cache:
        return cache[key]
    block_mask = block_mask_in_chunks(mask, q_len, device)
    if cache is not None:
        if len(cache) > 8:  # a handful of shapes per model (training, evaluation lengths)
            cache.clear()
        cache[key] = block_mask
    return block_mask


def block_mask_in_chunks(mask: AttentionMask, length: int, device: torch.device) -> BlockMask:
    """The block mask of `length` tokens attending to each other, as `create_block_mask` makes it
    (a tile is full when every pair in it is visible, partial when some are, and a tile past the
    end is never full), with the visibility formed a chunk of query tiles at a time (at most
    `DENSE_ELEMENTS` at once) and the tiles ordered by an eager sort. `create_block_mask` itself
    forms the whole Tq x Tk mask uncompiled (and int64 index grids with it: 8 GB at 32768 tokens)
    and compiled hits a Triton sort that compiles for minutes at 128 key tiles and more, that is
    from 16384 tokens on (pytorch/pytorch#182060, fixed after torch 2.11): the T=16384 step that
    never finished."""
    tiles = -(-length // BLOCK)
    keys = torch.arange(tiles * BLOCK, device=device)
    chunk = max(1, DENSE_ELEMENTS // (BLOCK * BLOCK * tiles))  # query tiles at once
    partial, full = [], []
    for first in range(0, tiles, chunk):
        rows = torch.arange(first * BLOCK, min(first + chunk, tiles) * BLOCK, device=device)
        visible = mask.visible(rows[:, None], keys[None, :])
        visible = visible & (rows < length)[:, None] & (keys < length)[None, :]
        seen = visible.view(-1, BLOCK, tiles, BLOCK).sum(dim=(1, 3))  # visible pairs per tile
        partial.append((seen > 0) & (seen < BLOCK * BLOCK))
        full.append(seen == BLOCK * BLOCK)
    return BlockMask.from_kv_blocks(
        *_ordered(torch.cat(partial)), *_ordered(torch.cat(full)), BLOCK_SIZE=BLOCK,
        mask_mod=mask.mask_mod(), seq_lengths=(length, length),
    )  # fmt: skip


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """(query tiles, key tiles) bool -> how many key tiles each query tile has, and their indices
    first (the layout of `BlockMask.from_kv_blocks`), with batch and head dimensions of 1."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], order[None, None]
