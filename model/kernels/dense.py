"""The dense context of the eager and SDPA kernels: the visibility mask and the additive score terms (the
scheme's position bias, a layer's token terms) as tensors. A (H, Tq, Tk) bias is formed whole only while small
(`DENSE_ELEMENTS`); past that, for blocks of query rows as they come, so memory grows linearly with the length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posgpt.model.kernels.base import Placement
from posgpt.model.masks import AttentionMask
from posgpt.model.recompute import recomputed
from posgpt.model.terms import ScoreBias, TokenTerms

DENSE_ELEMENTS = 1 << 24
"""Largest mask or bias (elements, over every batch row and head) formed at once: 64 MiB in float32; a recomputed
block's, with what its graph keeps, on a GPU 32 times that (`KEPT_PER_HEAD`; on a CPU `CPU_BLOCK_KEY_ELEMENTS`)."""

CPU_BLOCK_KEY_ELEMENTS = 1 << 14
"""A recomputed block's values per key on a CPU (4M at 256 keys, 16M from 1,024): what glibc keeps of freed blocks
then grows with the step (16M at 256 tokens held 4-5x RoPE's resident peak for FIRE and CoPE, 4M 2.2x; issue 62)."""

KEPT_PER_HEAD = {"eager": 12, "sdpa": 4}
"""Values per head and query-key pair a recomputed block's graph keeps beyond its terms, the eager kernel's (scores,
mask, weights, what the function forms: stick-breaking's backward the most) and SDPA's math kernel's; sizes its row
blocks, of at most `CPU_BLOCK_KEY_ELEMENTS` values per key on a CPU, 32 times `DENSE_ELEMENTS` on a GPU (more memory,
and each block costs launches: GPT-2 124M's blocks at B16 x T1024, as the issue-50 H100 run measured them)."""

RECOMPUTE_ELEMENTS = 1 << 22
"""Values per batch row a pass keeps for its backward pass (queries x keys x the larger of what its kernel keeps per
head, `KEPT_PER_HEAD`, and what the bias forms per pair, `ScoreBias.elements`) past which a pass with gradients
attends in blocks, each formed again in the backward pass (`model.recompute`): no O(T^2) activation is kept per
layer (but a whole mask or unlearned bias, one for every layer), at the cost of the blocks' forward twice. Counting
heads alone kept FIRE's MLP and the eager weights whole: FIRE 4.6 GB resident at 512 tokens (issue 62)."""

Weigh = Callable[[Tensor, Tensor], Tensor]
"""(scores (B, H, rows, Tk) with -inf where a key is not visible, visibility (.., rows, Tk) bool)
-> attention weights: what makes an attention function of the scores (softmax, sigmoid, ...)."""


@dataclass(frozen=True)
class DenseContext:
    """What eager and SDPA need of one forward pass: the positions the mask sees (`q_pos` (Bq, Tq), `k_pos`
    (Bk, Tk), -1 an empty slot), those the bias sees (`q_ids`, `k_ids`), the whole mask and bias when small
    (`whole`); `plain`: causal with no bias, which SDPA runs with no mask at all; `weigh`: the eager kernel's
    weights of the masked scores (`Weigh`), options bound: None in SDPA's."""

    bias: ScoreBias | None
    mask: AttentionMask
    n_head: int
    q_pos: Tensor
    k_pos: Tensor
    q_ids: Tensor
    k_ids: Tensor
    plain: bool
    whole: tuple[Tensor | None, Tensor | None] | None = None
    weigh: Weigh | None = None
    recompute: bool = False
    """A pass with gradients past `RECOMPUTE_ELEMENTS`: blocks whose weights would be kept are formed again."""
    in_order: bool = False
    """The ids are the tokens' own, 0..T-1: a bias of the distance alone is formed once per distance."""

    def rows_per_block(self, tokens: TokenTerms | None = None, queries: int = 0) -> int:
        """Query rows whose mask and additive terms (with a layer's `tokens`) stay within `DENSE_ELEMENTS`, with what
        a recomputed block's graph keeps for `queries` batch rows of queries (0: not recomputed)."""
        batch = max(self.q_pos.size(0), self.k_pos.size(0), self.q_ids.size(0), tokens.q.size(0) if tokens else 1)
        terms = batch * ((self.bias.elements if self.bias is not None else 1) + (self.n_head if tokens else 0))
        kept = queries * KEPT_PER_HEAD["sdpa" if self.weigh is None else "eager"] * self.n_head
        keys, cpu = self.k_pos.size(-1), self.q_pos.device.type == "cpu"
        budget = min(DENSE_ELEMENTS, CPU_BLOCK_KEY_ELEMENTS * keys) if cpu else 32 * DENSE_ELEMENTS
        return max(1, (budget if queries else DENSE_ELEMENTS) // ((terms + kept) * keys))

    def keeps(self, tokens: TokenTerms | None = None, dropout: bool = False) -> bool:
        """Whether the kernel keeps each block's weights for the backward pass: eager, or SDPA's math kernel, taken
        for a learned term or dropout (its CPU flash kernel keeps the block's mask alone)."""
        learned = tokens is not None or (self.bias is not None and self.bias.learned)
        return self.weigh is not None or learned or dropout

    def attend(self, run: Callable[[Tensor, Tensor, Tensor, slice], Tensor], q: Tensor, k: Tensor, v: Tensor,
               tokens: TokenTerms | None = None, dropout: bool = False) -> Tensor:  # fmt: skip
        """`run(q rows, k, v, rows)` over blocks of query rows, each at most `rows_per_block` rows, each formed again
        in the backward pass when `recompute` (`model.recompute`), unless the kernel keeps no weights and the mask is
        `whole`, formed once for every layer (ALiBi's bias, a window's); `dropout`: the same mask both times."""
        recompute = self.recompute and (self.whole is None or self.keeps(tokens, dropout))
        step = min(self.rows_per_block(tokens, q.size(0) if recompute else 0), q.size(-2))
        outs = []
        for c in range(0, q.size(-2), step):
            rows = slice(c, min(c + step, q.size(-2)))
            block = (q[:, :, rows], k, v, rows)
            outs.append(recomputed(run, *block, random=dropout) if recompute else run(*block))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def block(self, rows: slice, tokens: TokenTerms | None = None) -> tuple[Tensor | None, Tensor | None]:
        """Of query rows `rows`: the visibility (Bq, 1, rows, Tk) (None when `plain`) and the additive terms
        (B?, H, rows, Tk) in `model.terms`' order, the position bias and the layer's `tokens`, with -inf where
        not visible (None without either)."""
        if tokens is None and self.whole is not None and rows == slice(0, self.q_pos.size(-1)):
            return self.whole
        visible = self.mask.visible(self.q_pos[:, None, rows, None], self.k_pos[:, None, None, :])
        visible = visible & (self.k_pos >= 0)[:, None, None, :]
        bias, spread = None, self.bias is not None and self.bias.relative and self.in_order
        if spread and self.bias is not None and self.bias.formula is not None:
            keys = self.k_pos.size(-1)  # distances rows.stop - 1 down to rows.start - keys + 1, then row i's window
            distances = torch.arange(rows.stop - 1, rows.start - keys, -1, device=self.q_pos.device)[None]
            per_distance = self.bias.formula(torch.arange(self.n_head, device=distances.device)[:, None], distances,
                                             distances)  # fmt: skip
            if self.mask.causal_only:  # what it hides: the keys at distances below 0, masked before the spread
                per_distance = per_distance.masked_fill(distances < 0, float("-inf"))
            bias = per_distance.unfold(-1, keys, 1).flip(1)[None]  # (1, H, rows, Tk): no gather, nor its backward
        elif self.bias is not None and self.bias.formula is not None:
            heads = torch.arange(self.n_head, device=self.q_pos.device)[:, None, None]
            query = self.q_ids[:, None, rows, None]
            bias = self.bias.formula(heads, query - self.k_ids[:, None, None, :], query)  # once
        if tokens is not None:
            term = tokens.q[:, :, rows, None] - tokens.k[:, :, None, :]
            bias = term if bias is None else bias + term
        if bias is not None and not (spread and self.mask.causal_only):  # (masked before the spread)
            bias = bias.masked_fill(~visible, float("-inf"))
        return (None if self.plain else visible), bias


def dense_context(
    bias: ScoreBias | None, mask: AttentionMask, placement: Placement, weigh: Weigh | None = None
) -> DenseContext:
    """The dense context of one forward pass: the eager kernel's, with its weights `weigh`, or (None) SDPA's, for
    which plain causal attention needs no mask."""
    device = placement.device
    if placement.k_pos is not None:  # decoding through a cache: each row's own positions
        assert placement.positions is not None
        q_pos, k_pos, q_ids, k_ids = placement.positions, placement.k_pos, placement.positions, placement.k_pos
    else:
        q_pos = k_pos = torch.arange(placement.q_len, device=device)[None]
        q_ids = k_ids = placement.positions if placement.positions is not None else q_pos
    plain = weigh is None and mask.causal_only and placement.k_pos is None
    learned = bias is not None and bias.learned  # SDPA's math kernel: it keeps the weights too
    kept = KEPT_PER_HEAD["eager"] if weigh is not None else KEPT_PER_HEAD["sdpa"] if learned else 1
    per_pair = max(placement.n_head * kept, bias.elements if bias is not None else 0)  # FIRE's MLP: ~36 per head
    recompute = torch.is_grad_enabled() and per_pair * placement.q_len * k_pos.size(-1) > RECOMPUTE_ELEMENTS
    context = DenseContext(bias, mask, placement.n_head, q_pos, k_pos, q_ids, k_ids, plain, weigh=weigh,
                           recompute=recompute, in_order=placement.positions is None)  # fmt: skip
    if (context.recompute and context.keeps()) or context.rows_per_block() < placement.q_len:
        return context  # formed block by block
    visible, bias = context.block(slice(0, placement.q_len))
    if weigh is None and bias is None and visible is not None:  # SDPA: the mask as the additive term, made once
        visible, bias = None, torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))
    return dataclasses.replace(context, whole=(visible, bias))


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) bool, True where query i (at position k_len - q_len + i) may attend to key j."""
    return AttentionMask().dense(torch.arange(k_len - q_len, k_len, device=device), torch.arange(k_len, device=device))
