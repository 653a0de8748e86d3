"""Sigmoid attention (Ramapuram et al., ICLR 2025; apple/axlearn `SigmoidAttention`): each visible key
weighs sigmoid(s_ij - ln n), s_ij the score with the scheme's bias, not normalised over the keys; n is
`block_size` (`sigmoid_bias='train_length'`) or the keys query i sees (`seen_keys`).

The flex kernel is exact through FlexAttention's log-sum-exp: with the score m_ij = ln sigmoid(.),
flex returns sum_j sigmoid(.) v_j / Z_i and lse_i = ln Z_i, so the output times exp(lse) is sigmoid
attention's (on CUDA: compiled flex returns no lse on a CPU).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest

from posgpt.model.attention.softmax import SoftmaxAttention
from posgpt.model.kernels.base import Placement, Plan
from posgpt.model.kernels.eager import EagerKernel
from posgpt.model.kernels.flex import FlexKernel, ScoreMod
from posgpt.model.masks import AttentionMask
from posgpt.model.scores import Score
from posgpt.model.terms import Term

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


def sigmoid_weights(scores: Tensor, visible: Tensor, length: int | None) -> Tensor:
    """sigmoid(score - ln n), n = `length`, or with None the keys the query sees; 0 where the score is -inf."""
    if length is not None:
        return (scores - math.log(length)).sigmoid_()
    seen = visible.sum(dim=-1, keepdim=True).clamp(min=1)
    return (scores - torch.log(seen.to(scores.dtype))).sigmoid_()


class SigmoidEager(EagerKernel):
    """The reference: the eager kernel with sigmoid weights (n from `SigmoidAttention.kernel_settings`)."""

    weigh = staticmethod(sigmoid_weights)


class SigmoidFlex(FlexKernel):
    """FlexAttention with the log-sigmoid score, the output rescaled by exp(lse); CUDA only (module docstring)."""

    terms = FlexKernel.terms - {Term.MASS}

    def weights_mod(self, mask: AttentionMask, placement: Placement, **settings: Any) -> ScoreMod:
        """ln `sigmoid_weights` of z, the score with its terms (`length`: `SigmoidAttention.kernel_settings`)."""
        length: int | None = settings["length"]
        q_pos = placement.positions if placement.k_pos is not None else None  # decoding: the cache positions
        log_length = math.log(length) if length is not None else None

        def score_mod(z: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            if log_length is not None:
                return F.logsigmoid(z - log_length)
            query = q_pos[b, q_idx] if q_pos is not None else q_idx
            return F.logsigmoid(z - torch.log(mask.seen_keys(query).float()))

        return score_mod

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        out, aux = self.flex(q, k, v, plan, score, AuxRequest(lse=True))
        return (out.float() * aux.lse.exp()[..., None]).to(q.dtype)


class SigmoidAttention(SoftmaxAttention):
    """Sigmoid attention (this module): softmax attention's layer and KV cache with sigmoid weights."""

    kernels = {"eager": SigmoidEager(), "flex": SigmoidFlex()}

    @classmethod
    def kernel_settings(cls, config: GPTConfig) -> dict[str, Any]:
        return {"length": config.block_size if config.sigmoid_bias == "train_length" else None}  # None: keys seen
