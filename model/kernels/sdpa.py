"""The SDPA kernel: PyTorch's fused scaled_dot_product_attention (FlashAttention on GPU when there is
no bias and no mask beyond causal)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from posgpt.model.kernels.base import Kernel, Placement, Plan
from posgpt.model.kernels.dense import DenseContext, causal_mask, dense_context
from posgpt.model.masks import AttentionMask
from posgpt.model.scores import Score
from posgpt.model.terms import ScoreBias, Term

NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's backends but cuDNN's, for a masked call on CUDA that needs a gradient: cuDNN's backward gives NaN grad_q
when a mask or bias is passed, the length is 64 past a multiple of 128 and a row's log-sum-exp is very negative
(pytorch#196678, torch 2.13 with cuDNN 9.20); `is_causal=True` alone is clean and keeps every backend."""


def off_cudnn(q: Tensor) -> contextlib.AbstractContextManager:
    """Where a masked call needs a gradient on CUDA: SDPA without cuDNN (`NOT_CUDNN`); elsewhere, nothing."""
    guard = q.is_cuda and torch.is_grad_enabled() and q.requires_grad
    return sdpa_kernel(NOT_CUDNN) if guard else contextlib.nullcontext()


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """PyTorch's fused scaled_dot_product_attention: `is_causal=True` with no bias or mask (FlashAttention
    on GPU, which reads grouped KV heads itself), else the bias (-inf where not visible) or the boolean mask as
    `attn_mask` (grouped KV heads repeated first: no other backend takes them without falling back to the math
    one, PyTorch issue 139586). On a CPU, bf16 / fp16 inputs are attended in float32: its bf16 kernel measured
    1.1-4x slower (BENCHMARKS.md, "bf16 on the CPU")."""
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        with torch.autocast("cpu", enabled=False):
            return sdpa_attention(q.float(), k.float(), v.float(), bias, dropout_p, mask, scale).to(q.dtype)
    q_len, k_len = q.size(-2), k.size(-2)
    masked = bias is not None or mask is not None or q_len not in (k_len, 1)
    if k.size(1) != q.size(1) and masked:  # grouped heads: FlashAttention's alone, which takes no mask
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout_p, scale=scale,
                             enable_gqa=k.size(1) != q.size(1))  # fmt: skip
    if bias is not None:  # in q's dtype: cuDNN once read an fp32 mask as bf16 bits (pytorch PR #191612)
        with off_cudnn(q):
            return sdpa(q, k, v, attn_mask=bias.to(q.dtype))
    if mask is not None:
        with off_cudnn(q):
            return sdpa(q, k, v, attn_mask=mask)
    if q_len == k_len:
        return sdpa(q, k, v, is_causal=True)
    if q_len == 1:  # one new token attends to every cached key: no mask at all
        return sdpa(q, k, v)
    return sdpa(q, k, v, attn_mask=causal_mask(q_len, k_len, q.device))


class SdpaKernel(Kernel):
    """`torch.nn.functional.scaled_dot_product_attention`; `is_causal=True` with no bias, so PyTorch can pick
    FlashAttention; a bias goes in as a float mask (a T×T tensor per head, formed whole only up to 16M elements, past
    that for blocks of query rows: memory linear in T). On a CPU, bf16 inputs are attended in float32: the CPU
    kernel's bf16 path measured 1.1-3x slower up to 512 tokens.

    Fused, on every device, with every additive term, mask and dropout; dot-product scores only."""

    terms = frozenset({Term.POSITIONS, Term.TOKENS, Term.MASK})
    term_gradients = True
    dropout = True
    grouped_kv = True

    def context(
        self, bias: ScoreBias | None, mask: AttentionMask, placement: Placement, memo: dict, **settings: Any
    ) -> DenseContext:
        return dense_context(bias, mask, placement)

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        context: DenseContext = plan.context

        def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
            if context.recompute and v.size(-1) != q.size(-1) and not dropout_p:  # differential's wider values:
                parts = v.split(q.size(-1), dim=-1)  # the CPU's flash kernel takes equal heads, or keeps the scores
                return torch.cat([sdpa_attention(q, k, part, bias, 0.0, mask, score.scale) for part in parts], dim=-1)
            return sdpa_attention(q, k, v, bias, dropout_p, mask, score.scale)

        if context.plain and context.bias is None and plan.tokens is None:  # causal over every key: no mask at all
            return attend(q, k, v)

        def rows_of(q_rows: Tensor, k: Tensor, v: Tensor, rows: slice) -> Tensor:  # one block unless large
            visible, bias = context.block(rows, plan.tokens)
            return attend(q_rows, k, v, bias, visible)

        return context.attend(rows_of, q, k, v, plan.tokens, dropout_p > 0)
