"""The eager kernel: softmax attention written out in float32, the reference every kernel is tested
against, and the one that forms the attention weights (attention maps)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posgpt.model.kernels.base import WEIGHTS_CHUNK_ELEMENTS, Kernel, Placement, Plan, WeightsHook
from posgpt.model.kernels.dense import DenseContext, Weigh, causal_mask, dense_context
from posgpt.model.masks import AttentionMask
from posgpt.model.scores import ScaledDot, Score
from posgpt.model.terms import ScoreBias, ScoresTerm, Term


def softmax_weights(scores: Tensor, visible: Tensor, sinks: Tensor | None = None) -> Tensor:
    """Softmax attention's weights: the softmax over the visible keys; with `sinks` (H,), over them and one keyless
    logit per head (`Term.MASS`), whose share is left out."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    mask: Tensor | None = None,
    score: Score | None = None,
    on_weights: WeightsHook | None = None,
    weigh: Weigh = softmax_weights,
    term: ScoresTerm | None = None,
    transform: Callable[[Tensor], Tensor] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """softmax(score(q, k) + bias, over the visible keys) v, written out in (at least) float32, in chunks of
    queries when the score or `on_weights` needs it; the (B, H, Tq, D) output in q's dtype.

    Args:
        q: (B, H, Tq, D) queries; k, v: (B, H, Tk, D) keys and values.
        bias: additive (H, Tq, Tk) or (B, H, Tq, Tk) score bias (-inf where not visible), or None.
        mask: (Tq, Tk) or (B, 1, Tq, Tk) bool visibility; None: causal, the queries the last Tq keys.
        score: the scoring function (default: scaled dot product).
        on_weights: called with each chunk of weights (query rows, (B, H, rows, Tk), after dropout).
        weigh: the weights of the masked scores (default: the softmax).
        term: a term computed from the masked scores, added to them (`Term.FROM_SCORES`: CoPE).
        transform: a function of the scores, before the bias (`Term.TRANSFORM`: a soft-cap).
        sinks: (H,) keyless logits in the softmax's normaliser (`Term.MASS`; `weigh` takes them).
    """
    q_len, k_len = q.size(-2), k.size(-2)
    dtype = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 if given float64
    score = score if score is not None else ScaledDot(q.size(-1))
    visible = mask if mask is not None else causal_mask(q_len, k_len, q.device)
    qw, kw, vw = q.to(dtype), k.to(dtype), v.to(dtype)
    outs = []
    step = score.query_chunk(qw, kw)
    if on_weights is not None:
        step = min(step, max(1, WEIGHTS_CHUNK_ELEMENTS // (q.size(0) * q.size(1) * k_len)))
    for c in range(0, q_len, step):
        rows = slice(c, min(c + step, q_len))
        seen = visible[..., rows, :]
        scores = score(qw[:, :, rows], kw)  # (B, H, chunk, Tk)
        if transform is not None:
            scores = transform(scores)
        if bias is not None:
            scores = scores + bias[..., rows, :].to(dtype)
        scores = scores.masked_fill_(~seen, float("-inf"))  # (in place: no op before keeps its output)
        if term is not None:
            scores = (scores + term(qw[:, :, rows], scores, seen)).masked_fill_(~seen, float("-inf"))
        weights = F.dropout(weigh(scores, seen) if sinks is None else weigh(scores, seen, sinks), p=dropout_p)
        outs.append(weights @ vw)  # (B, H, chunk, D)
        if on_weights is not None:
            on_weights(rows, weights)
    return torch.cat(outs, dim=2).to(q.dtype)


class EagerKernel(Kernel):
    """Everything, slowly: any score, term, mask and dropout, on every device, and the weights. A function of the
    scores subclasses it with its own `weigh`, its options (`Attention.kernel_settings`) bound; sink logits only
    with the softmax's weights (`SoftmaxEager`)."""

    weigh: Weigh = staticmethod(softmax_weights)

    terms = frozenset(Term) - {Term.MASS}
    term_gradients = True
    dropout = True
    weights = True
    any_score = True

    def context(
        self, bias: ScoreBias | None, mask: AttentionMask, placement: Placement, memo: dict, **settings: Any
    ) -> DenseContext:
        return dense_context(bias, mask, placement, functools.partial(self.weigh, **settings))

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        """`eager_attention` with the context's weights, a block of query rows at a time."""
        context: DenseContext = plan.context
        term = context.bias.from_scores if context.bias is not None else None
        weigh = context.weigh or self.weigh  # a context built by another dense kernel (SDPA's) has none

        def rows_of(q_rows: Tensor, k: Tensor, v: Tensor, rows: slice) -> Tensor:  # one block unless large
            visible, bias = context.block(rows, plan.tokens)

            def hook(chunk: slice, weights: Tensor) -> None:  # `on_weights` of the pass's rows, not the block's
                plan.on_weights(slice(chunk.start + rows.start, chunk.stop + rows.start), weights)

            on_block = hook if plan.on_weights is not None else None
            return eager_attention(q_rows, k, v, bias, dropout_p, visible, score, on_block, weigh, term, plan.transform,
                                   plan.sinks)  # fmt: skip

        return context.attend(rows_of, q, k, v, plan.tokens, dropout_p > 0)


class SoftmaxEager(EagerKernel):
    """Each function's reference, written out in float32 (softmax attention's: softmax(QKᵀ/√d + bias + mask)·V); it
    returns the attention weights too; past 16M elements its mask and bias are formed for blocks of query rows.

    The eager kernel, with sink logits in the softmax (`Term.MASS`)."""

    terms = frozenset(Term)
