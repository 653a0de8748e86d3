"""FlexAttention's block masks, built eagerly a chunk of query tiles at a time (`block_mask_in_chunks`).
It imports Dynamo: flex.py imports it at the first forward pass that needs it, so `import posgpt.model` stays cheap."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from posgpt.model.kernels.base import Placement
from posgpt.model.kernels.dense import DENSE_ELEMENTS
from posgpt.model.masks import AttentionMask

BLOCK = 128
"""FlexAttention's sparse block: a block mask says which BLOCK x BLOCK tiles of the scores to compute."""


@torch.compiler.disable  # built eagerly, also inside a compiled model: see `block_mask_in_chunks`
def eager_block_mask(mask: AttentionMask, placement: Placement, cache: dict) -> BlockMask:
    """The block mask of `mask` for a forward pass, kept per shape in `cache`; decoding builds one per step."""
    q_len, device = placement.q_len, placement.device
    if placement.k_pos is not None:
        q_pos, k_pos = placement.positions, placement.k_pos

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            k = k_pos[b, kv_idx]
            return mask.visible(q_pos[b, q_idx], k) & (k >= 0)

        return create_block_mask(mask_mod, q_pos.size(0), None, q_len, k_pos.size(-1), device=device)
    key = (mask, q_len, str(device))
    if key not in cache:
        if len(cache) > 8:  # a handful of shapes per model (training, evaluation lengths)
            cache.clear()
        cache[key] = block_mask_in_chunks(mask, q_len, device)
    return cache[key]


def block_mask_in_chunks(mask: AttentionMask, length: int, device: torch.device) -> BlockMask:
    """The block mask of `length` tokens attending to each other, as `create_block_mask` makes it, with the
    visibility formed a chunk of query tiles at a time and the tiles ordered by an eager sort:
    `create_block_mask` forms the whole Tq x Tk mask uncompiled (8 GB at 32768 tokens), and compiled it hits
    a Triton sort that compiles for minutes from 16384 tokens on (pytorch/pytorch#182060)."""
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
        mask_mod=lambda b, h, q, k: mask.visible(q, k), seq_lengths=(length, length),  # tokens at 0.. see each other
    )  # fmt: skip


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """(query tiles, key tiles) bool -> key tiles per query tile and their indices (`BlockMask.from_kv_blocks`)."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], order[None, None]
