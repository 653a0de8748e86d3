"""The output layer and the cross-entropy in one pass over chunks of rows, never forming the whole
(N, V) logits (3.3 GB in float32 for GPT-2 at 16 x 1024, and their gradient as much again).

Each chunk's logits give its share of the loss and, in the same pass, its gradients for the states
and the head's weight (softmax - one-hot), then are dropped: liger-kernel's fused linear
cross-entropy in plain PyTorch. It computes `F.cross_entropy(hidden @ weight.T, targets,
ignore_index=-1)`, in float32; the backward pass scales the stored gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 24
"""Logits formed at once: rows per chunk = this // vocabulary (64 MiB in float32)."""


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """The mean cross-entropy of `hidden` (N, C) @ `weight.T` (V, C) against `targets` (N,) (-1: ignored)."""
    return _LinearCrossEntropy.apply(hidden, weight, targets, max(1, CHUNK_ELEMENTS // weight.size(0)))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, rows: int) -> Tensor:
        head = weight.to(hidden.dtype)  # the plain path's head runs in the states' dtype too
        wide = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 if given float64
        kept = targets != -1  # -1: ignored
        count = kept.sum()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        for start in range(0, hidden.size(0), rows):
            part = slice(start, start + rows)
            logits = (hidden[part] @ head.T).to(wide)  # (n, V)
            target, keep = targets[part].clamp(min=0)[:, None], kept[part, None]
            log_z = logits.logsumexp(dim=-1, keepdim=True)
            total += ((log_z - logits.gather(1, target)) * keep).sum()
            grad = torch.exp(logits - log_z)  # d loss_i / d logits_i: softmax - one-hot, for kept rows
            grad.scatter_add_(1, target, torch.full_like(log_z, -1.0))
            grad *= keep
            grad_hidden[part] = grad.to(hidden.dtype) @ head
            grad_weight += grad.T @ hidden[part].to(wide)
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return total / count  # NaN when every target is ignored, as F.cross_entropy's mean

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None]:
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return (grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype), None, None)
