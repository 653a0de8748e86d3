"""The dense context of the eager and SDPA kernels: a (Tq, Tk) visibility mask and the scheme's
score bias written out as a tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.kernels.base import Step
from model.masks import AttentionMask
from model.positions import PositionEncoding


@dataclass(frozen=True)
class DenseContext:
    """`mask`: the (Tq, Tk) visibility (None when SDPA can use its own causal shortcut); `bias`: the
    scheme's (H, Tq, Tk) score bias, or (B, H, T, T) with per-row positions, with -inf where a key is
    not visible (None without a bias)."""

    mask: Tensor | None = None
    bias: Tensor | None = None


def dense_context(pe: PositionEncoding, mask: AttentionMask, step: Step, shortcut: bool) -> DenseContext:
    """Mask and bias of one forward pass. With `shortcut`, plain causal attention over keys 0..end-1
    gets no mask (the kernel's own causal path); the positions the scheme sees are `step.ids` when
    given, while the mask stays on token order (the ids increase along a row)."""
    device = step.device
    q_pos = torch.arange(step.q_start, step.q_start + step.q_len, device=device)
    keys = step.k_pos if step.k_pos is not None else torch.arange(step.k_len, device=device)
    plain = mask.causal_only and step.k_pos is None
    visible = None if plain and shortcut else _visible(mask, q_pos, keys)
    bias = None
    if pe.score_bias:
        heads = torch.arange(step.n_head, device=device)[:, None, None]
        if step.ids is None:
            distance = (q_pos[:, None] - keys[None, :])[None]  # (1, Tq, Tk)
        else:
            distance = (step.ids[:, :, None] - step.ids[:, None, :])[:, None]  # (B, 1, T, T)
        bias = pe.relative_bias(heads, distance)  # (H, Tq, Tk) or (B, H, T, T): the formula written once
        bias = bias.masked_fill(~(visible if visible is not None else _visible(mask, q_pos, keys)), float("-inf"))
    return DenseContext(visible, bias)


def _visible(mask: AttentionMask, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    return mask.dense(q_pos, k_pos) & (k_pos >= 0)[None, :]


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) bool, True where query i (at position k_len - q_len + i) may attend to key j."""
    return AttentionMask().dense(torch.arange(k_len - q_len, k_len, device=device), torch.arange(k_len, device=device))
