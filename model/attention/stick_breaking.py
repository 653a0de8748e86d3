"""Stick-breaking attention (Tan et al., ICLR 2025; shawntan/stickbreaking-attention `sb_ref.py`): no softmax and
no position embedding needed. Key j takes beta_ij = sigmoid(s_ij) of what the keys nearer the query left over,
A_ij = beta_ij * prod_{j<t<i} (1 - beta_it), computed in log space; the query's own key is not attended
(`attend_current=False`, the official default). What no key takes, 1 - sum_j A_ij, goes to the query's own
value (`sb_remainder: current`, the paper-era training code's `sb_remainder=True`) or is dropped (`drop`).

The weights of a row need all its scores at once, so the function runs on the eager kernel, or on CUDA on fla's
fused one (`model/kernels/fla.py`); its KV cache never rolls, so that cached keys stay in position order, the order
the product runs over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posgpt.model.attention.softmax import SoftmaxAttention
from posgpt.model.kernels.eager import EagerKernel
from posgpt.model.kernels.fla import FlaStickBreaking

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


def stick_breaking_weights(scores: Tensor, visible: Tensor, remainder: bool) -> Tensor:
    """Weights (B, H, rows, Tk) of scores with -inf where a key is not visible. Keys are in position order, so
    the query's own key is the last one it sees: it takes no share, only the remainder (with `remainder`)."""
    own = visible.size(-1) - 1 - visible.flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)
    current = torch.zeros_like(visible).scatter(-1, own, True)
    keys = visible & ~current
    z = scores.masked_fill(~keys, 0.0)  # no -inf in the arithmetic (nor in its gradient)
    log_rest = F.logsigmoid(-z).masked_fill(~keys, 0.0)  # ln(1 - beta), 0 where no key
    suffix = log_rest.flip(-1).cumsum(-1).flip(-1)  # sum over keys t >= j
    after = torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1)  # t > j: nearer the query
    weights = torch.exp(F.logsigmoid(z) + after).masked_fill(~keys, 0.0)
    if remainder:
        weights = weights + torch.exp(suffix[..., :1]) * current  # prod of (1 - beta) over every key
    return weights


class StickBreakingEager(EagerKernel):
    """The eager kernel with stick-breaking weights (any score, bias, mask and dropout)."""

    weigh = staticmethod(stick_breaking_weights)


class StickBreakingAttention(SoftmaxAttention):
    """Stick-breaking attention (this module): softmax attention's layer with stick-breaking weights."""

    kernels = {"eager": StickBreakingEager(), "fla": FlaStickBreaking()}
    keys_in_order = True  # its KV cache never rolls (the window still masks)

    @classmethod
    def kernel_settings(cls, config: GPTConfig) -> dict[str, Any]:
        return {"remainder": config.sb_remainder == "current"}
