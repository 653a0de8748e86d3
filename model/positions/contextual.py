"""Positions that depend on the content: CoPE (Golovneva et al. 2024, "Contextual Position Encoding"; the
authors' code, facebookresearch/RAM projects/cope `ContextPosSelfAttn`). Query i gates each key it sees,
g_ij = sigmoid(s_ij), s the score (q_i . k_j / sqrt(d)), and counts the gates from key j up to itself:
p_ij = sum_{t=j..i} g_it, clamped to P - 1. A learned vector e[p] per integer position, one table per layer
shared by its heads and started at zero, is read between floor(p) and ceil(p) on the logits q_i . e: the term
(1 - w) q.e[floor p] + w q.e[ceil p], w = p - floor p, is divided by sqrt(d) with q.k (their training code,
`cope_divide`) or added undivided (the paper's appendix code).

The term needs the scores, so only a kernel that forms them runs it (eager); keys must be in position order,
so its KV cache never rolls (`SoftmaxAttention.new_cache`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from model.positions.base import PositionEncoding, ScoreBias, ScoresTerm

if TYPE_CHECKING:
    from model.config import GPTConfig


def cope_term(table: Tensor, scale: float) -> ScoresTerm:
    """CoPE's term for one layer's table (D, P), times `scale`."""
    last = table.size(-1) - 1

    def term(q: Tensor, scores: Tensor, visible: Tensor) -> Tensor:
        gates = torch.sigmoid(scores)  # 0 where a key is not visible (a score of -inf)
        p = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=last)  # the gates from key j on, up to the query
        logits = q @ table.to(q.dtype)  # (B, H, rows, P): the query against every position
        low = p.floor()
        w = p - low  # the gradient reaches the gates through the interpolation only
        below, above = logits.gather(-1, low.long()), logits.gather(-1, p.ceil().long())
        return scale * (below + w * (above - below))

    return term


class ContextualPositions(PositionEncoding):
    """CoPE (module docstring): a (D, P) table per layer, zeros at the start; P = `cope_positions`."""

    score_bias = True
    learned_bias = True
    contextual = True
    uses_positions = False  # it counts what the query attends to, not indices
    fields = ("cope_positions", "cope_divide")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.bias_layers = config.n_layer
        positions = config.cope_positions or config.block_size + 1  # their default: every count up to block_size
        self.table = nn.Parameter(torch.zeros(config.n_layer, config.head_dim, positions))
        self.scale = 1 / math.sqrt(config.head_dim) if config.cope_divide else 1.0

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.table)

    def bias(self, layer: int = 0) -> ScoreBias:
        table = self.table[layer]
        # elements: the gates, counts, interpolation and term it forms per query-key pair, for the row blocks
        return ScoreBias(None, 4, from_scores=cope_term(table.to(torch.promote_types(table.dtype, torch.float32)),
                                                        self.scale))  # fmt: skip
