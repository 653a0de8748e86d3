"""The flex kernel: FlexAttention, with the mask as a block mask (blocks no query sees are skipped)
and the scheme's bias as a score modification, both fused in one compiled kernel.

`auto` picks it on CUDA for a score bias or a window while training or scoring whole sequences: in
torch 2.13 FlexAttention has no CPU backward pass and compiles for ~15 s per new shape there, while
SDPA's CPU kernels are fast enough; and it is not picked for decoding (one compile per length).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from model.kernels.base import Kernel, Needs, Step, WeightsHook
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


@functools.cache
def compiled_create_block_mask() -> Callable[..., BlockMask]:
    """create_block_mask compiled once per process (as torchtitan does): uncompiled, it builds the
    dense Tq x Tk mask that a block mask exists to avoid."""
    return torch.compile(create_block_mask)


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


def score_mod_of(pe: PositionEncoding, step: Step) -> ScoreMod:
    """The scheme's bias as a FlexAttention score_mod: the same `relative_bias` as the dense path."""
    q_start, k_pos, ids, q_pos = step.q_start, step.k_pos, step.ids, step.q_pos
    if q_pos is not None and k_pos is not None:  # decoding: each row at its own positions

        def score_mod_rows(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + pe.relative_bias(h, q_pos[b, q_idx] - k_pos[b, kv_idx])

        return score_mod_rows
    if ids is not None:

        def score_mod_ids(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + pe.relative_bias(h, ids[b, q_idx] - ids[b, kv_idx])

        return score_mod_ids

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + pe.relative_bias(h, q_idx + q_start - kv_idx)

    return score_mod


def build_block_mask(mask: AttentionMask, step: Step, cache: dict | None) -> BlockMask:
    """The block mask of `mask` for a forward pass, built once per shape and reused (in `cache`) by
    later forwards: on CUDA through a compiled `create_block_mask`, which never materialises the
    dense Tq x Tk mask. Decoding through a cache (each row at its own positions, which change every
    step) builds one per step, per row."""
    q_start, q_len, device = step.q_start, step.q_len, step.device
    build = compiled_create_block_mask() if device.type == "cuda" else create_block_mask
    if step.q_pos is not None and step.k_pos is not None:
        q_pos, k_pos = step.q_pos, step.k_pos

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            k = k_pos[b, kv_idx]
            return mask.visible(q_pos[b, q_idx], k) & (k >= 0)

        return build(mask_mod, q_pos.size(0), None, q_len, k_pos.size(-1), device=device)
    key = (mask, q_start, q_len, str(device))
    if cache is not None and key in cache:
        return cache[key]
    block_mask = build(mask.mask_mod(q_start), None, None, q_len, q_start + q_len, device=device)
    if cache is not None:
        if len(cache) > 8:  # a handful of shapes per model (training, evaluation lengths)
            cache.clear()
        cache[key] = block_mask
    return block_mask


@dataclass(frozen=True)
class FlexContext:
    block_mask: BlockMask
    score_mod: ScoreMod | None


class FlexKernel(Kernel):
    """Fused with a block-sparse mask and an in-kernel bias; no dropout, a backward pass on CUDA only."""

    score_bias = True
    bias_gradients = True
    backward_devices = frozenset({"cuda"})
    auto_devices = frozenset({"cuda"})
    sparse_masks = True

    def rank(self, needs: Needs, device: torch.device) -> float:
        # first for a bias or a window on CUDA when the lengths repeat; after SDPA otherwise
        return 0.0 if (needs.score_bias or needs.sparse_mask) and not needs.decoding else 1.5

    def context(self, pe: PositionEncoding, mask: AttentionMask, step: Step, memo: dict) -> FlexContext:
        block_mask = build_block_mask(mask, step, memo)
        score_mod = score_mod_of(pe, step) if pe.score_bias else None
        return FlexContext(block_mask, score_mod)

    def run(
        self, q: Tensor, k: Tensor, v: Tensor, context: FlexContext, score: Score, dropout_p: float,
        on_weights: WeightsHook | None,
    ) -> Tensor:  # fmt: skip
        return flex_attention_fused(q, k, v, context.block_mask, context.score_mod, scale=score.scale)
