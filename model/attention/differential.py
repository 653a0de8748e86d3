"""Differential attention's layer (Ye et al., ICLR 2025): two softmax maps on softmax attention's kernels."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from posgpt.core.errors import ConfigError
from posgpt.model.attention.softmax import SoftmaxAttention
from posgpt.model.cache import LayerCache
from posgpt.model.kernels import Placement, Plan, WeightsHook
from posgpt.model.positions import SCHEMES, PositionEncoding
from posgpt.model.scores import SCORES
from posgpt.model.terms import Term

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


class DifferentialAttention(SoftmaxAttention):
    """Differential attention (Ye et al., ICLR 2025; microsoft/unilm Diff-Transformer/multihead_diffattn.py):
    (softmax(q1 k1^T / sqrt(d)) - lambda softmax(q2 k2^T / sqrt(d))) v over the two halves (d = D / 2) of each
    head, lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, each head's output RMS-normalised and scaled
    by 1 - lambda_init. Both maps run on softmax attention's kernels; `diff_split` says how a head splits
    (docs/model.md)."""

    value_passes = 2

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        half = self.head_dim // 2
        self.score = self.score.scoring(half)  # each map scores d = D / 2 dimensions: 1 / sqrt(d)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer)  # the paper's l - 1 = this 0-based index
        # lq1, lk1, lq2, lk2: vectors (no weight decay, as every 1-D parameter)
        self.lambdas = nn.ParameterList(nn.Parameter(torch.empty(half).normal_(mean=0.0, std=0.1)) for _ in range(4))
        self.head_norm = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.split = config.diff_split
        if self.split == "half_heads":
            index = torch.arange(self.head_dim).view(2, half)  # map 1: the first half, map 2: the second
        else:  # rope_pairs: (half of the head, pair, parity) -> the even pairs, then the odd ones
            index = torch.arange(self.head_dim).view(2, half // 2, 2).permute(2, 0, 1).reshape(2, half)
        self.register_buffer("halves", index, persistent=False)

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        neox = config.rope_fraction != 1.0 and config.rope_partial == "neox"
        refusals = {  # each refusal: whether it applies (the first that does is raised)
            f"attention='differential' splits each head in two halves of whole RoPE pairs, so the head size n_embd / "
            f"n_head = {config.head_dim} must be a multiple of 4: change n_embd or n_head.": config.head_dim % 4,
            f"attention='differential' scores half-heads, and pos_encoding={config.pos_encoding!r} reads its "
            "positions from whole heads' scores: use another pos_encoding, or an attention function that scores "
            "whole heads.": Term.FROM_SCORES in SCHEMES[config.pos_encoding].terms,
            "GPTConfig.attn_sink_logits adds a keyless logit to one softmax, and attention='differential' takes the "
            "difference of two: use attention 'softmax' or 'forgetting', or "
            "attn_sink_logits false.": config.attn_sink_logits,
            f"attention='differential' scores half of each head per map, a dot product; attn_score="
            f"{config.attn_score!r} is not one: use attn_score scaled_dot, dot or "
            "general.": not SCORES[config.attn_score].dot_product,
            "attention='differential' with diff_split='rope_pairs' splits heads by RoPE pairs of the whole head, "
            "which rope_partial='neox' does not make: use diff_split='half_heads', rope_partial='p_rope', or "
            "rope_fraction 1.": neox and config.diff_split == "rope_pairs",
        }
        for refusal, applies in refusals.items():
            if applies:
                raise ConfigError(refusal)

    @classmethod
    def kernel_head_size(cls, head_dim: int) -> int:
        return head_dim // 2

    @classmethod
    def rotary_dim(cls, config: GPTConfig) -> int:
        return config.head_dim // 2 if config.diff_split == "half_heads" else config.head_dim

    def rotate(self, pe: PositionEncoding, q: Tensor, k: Tensor, placement: Placement) -> tuple[Tensor, Tensor]:
        if self.split != "half_heads":
            return super().rotate(pe, q, k, placement)
        halves = [t.unflatten(-1, (2, -1)).transpose(2, 3).flatten(1, 2) for t in (q, k)]  # (B, 2H, T, d)
        q2, k2 = pe.rotate(*halves, placement.positions, placement.rotation)
        return tuple(t.unflatten(1, (-1, 2)).transpose(2, 3).flatten(-2) for t in (q2, k2))  # (B, H, T, D)

    def weight(self) -> Tensor:
        """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, a float32 scalar."""
        lq1, lk1, lq2, lk2 = (p.float() for p in self.lambdas)
        return torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + self.lambda_init

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerCache | None = None) -> Tensor:
        q, k, v = self.attended(x, pe, plan, cache)
        lam = self.weight()
        maps = _difference_hooks(plan.on_weights, lam)
        (q1, q2), (k1, k2) = (t[..., self.halves].unbind(-2) for t in (q, k))  # (B, H, T, d) each
        y1 = self.attend(dataclasses.replace(plan, on_weights=maps[0]), q1, k1, v)
        y2 = self.attend(dataclasses.replace(plan, on_weights=maps[1]), q2, k2, v)
        # the difference in float32 (it cancels where lambda is near 1), normalised in the gain's dtype
        y = (y1.float() - lam * y2.float()).to(self.head_norm.weight.dtype)
        y = self.head_norm(y).to(y1.dtype) * (1.0 - self.lambda_init)
        return self.output(y, x)


def _difference_hooks(on_weights: WeightsHook | None, lam: Tensor) -> tuple[WeightsHook | None, WeightsHook | None]:
    """Hooks for the two maps' weights that hand `on_weights` w1 - lambda w2, row block by row block."""
    if on_weights is None:
        return None, None
    first: dict[tuple[int, int], Tensor] = {}

    def keep(rows: slice, weights: Tensor) -> None:
        first[(rows.start, rows.stop)] = weights

    def combine(rows: slice, weights: Tensor) -> None:
        on_weights(rows, first.pop((rows.start, rows.stop)) - lam.to(weights.dtype) * weights)

    return keep, combine
