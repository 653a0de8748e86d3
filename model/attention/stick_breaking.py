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
    return StickBreaking.apply(scores, visible, remainder)


class StickBreaking(torch.autograd.Function):
    """`stick_breaking_weights` with its gradient written out: the graph keeps the scores and weights, where autograd's
    kept a dozen (B, H, rows, Tk) tensors (issue 62). With beta = sigmoid(z), A_j key j's weight, G the weights'
    gradient, R the remainder: dL/dz_j = G_j A_j (1 - beta_j) - beta_j (sum_{i<j} G_i A_i + G_own R)."""

    @staticmethod
    def keys(visible: Tensor) -> tuple[Tensor, Tensor]:
        """The query's own key (the last it sees) as an index (.., rows, 1), and the keys that take a share."""
        own = visible.size(-1) - 1 - visible.flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)
        return own, visible & ~torch.zeros_like(visible).scatter(-1, own, True)

    @staticmethod
    def forward(ctx: Any, scores: Tensor, visible: Tensor, remainder: bool) -> Tensor:
        own, keys = StickBreaking.keys(visible)
        z = scores.masked_fill(~keys, 0.0)  # no -inf in the arithmetic (nor in its gradient)
        suffix = F.logsigmoid(-z).masked_fill_(~keys, 0.0).flip(-1).cumsum_(-1).flip(-1)  # sum of ln(1 - beta), t >= j
        rest, after = suffix[..., :1].exp(), F.pad(suffix[..., 1:], (0, 1))  # every key; t > j: those nearer the query
        del suffix
        weights = after.add_(F.logsigmoid(z)).exp_().masked_fill_(~keys, 0.0)
        if remainder:  # the product of (1 - beta) over every key, to the query's own value
            weights.scatter_add_(-1, own.expand(*weights.shape[:-1], 1), rest)
        ctx.save_for_backward(z, weights, visible)
        ctx.remainder = remainder
        return weights

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        z, weights, visible = ctx.saved_tensors
        own, keys = StickBreaking.keys(visible)
        taken = (grad * weights).masked_fill_(~keys, 0.0)  # G_i A_i
        before = F.pad(taken.cumsum(-1)[..., :-1], (1, 0))  # sum over i < j
        if ctx.remainder:  # G_own R
            own = own.expand(*weights.shape[:-1], 1)
            before += grad.gather(-1, own) * weights.gather(-1, own)
        return taken.sub_(before.add_(taken).mul_(torch.sigmoid(z))).masked_fill_(~keys, 0.0), None, None


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
