"""Causal self-attention and its three kernels: eager (the reference), SDPA and FlexAttention.

Shapes: B batch, H heads, Tq / Tk query / key lengths, D head size, C = H * D model width.
Queries are always the last Tq of the Tk key positions (Tq == Tk in a plain forward).

Which kernel `attn_backend="auto"` runs (`resolve_backend`):

| scheme                              | CUDA                                   | CPU / other |
|-------------------------------------|----------------------------------------|-------------|
| learned, sinusoidal, rope, none     | sdpa, is_causal=True (FlashAttention)  | sdpa        |
| alibi                               | flex (bias computed inside the kernel) | sdpa        |
| alibi with attention dropout active | sdpa (flex has no dropout)             | sdpa        |
| alibi, decoding with a KV cache     | sdpa (small bias, no per-length compile)| sdpa        |

`auto` never picks flex off CUDA: in torch 2.13 FlexAttention has no CPU backward pass and
compiles for ~15 s per new shape there, while SDPA's CPU kernels are fast enough.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from model.cache import LayerCache
from model.config import GPTConfig
from model.positions import PositionEncoding, ScoreMod


@dataclass(frozen=True)
class AttentionContext:
    """What every layer's attention needs for one forward pass, built once by `GPT`.

    For eager and SDPA `bias` is the position scheme's (H, Tq, Tk) score bias with -inf on the
    masked (future) keys, or None when the scheme has no bias. For flex, `block_mask` holds the
    causal structure and `score_mod` the bias.
    """

    backend: str
    q_len: int
    k_len: int
    bias: Tensor | None = None
    block_mask: BlockMask | None = None
    score_mod: ScoreMod | None = None

    @property
    def start(self) -> int:
        """Absolute position of the first query."""
        return self.k_len - self.q_len


def resolve_backend(
    requested: str,
    pos_encoding: str,
    device: torch.device,
    dropout_active: bool,
    needs_grad: bool,
    decoding: bool = False,
) -> str:
    """The kernel to run for this forward (see the table in the module docstring).

    Resolved per forward rather than at construction because the device, grad mode and train/eval
    mode are only known then; it is a handful of comparisons on Python values. `decoding` (new
    tokens against a KV cache) keeps `auto` on SDPA: its bias is then only (H, Tq, Tk) with Tq
    small, while FlexAttention would compile a kernel for every new cache length.
    """
    backend = requested
    if requested == "auto":
        fused_bias = pos_encoding == "alibi" and device.type == "cuda" and not (dropout_active or decoding)
        backend = "flex" if fused_bias else "sdpa"
    if backend == "flex" and needs_grad and device.type != "cuda":
        raise RuntimeError(
            f"attn_backend='flex' has no backward pass on {device.type} in this PyTorch: train with "
            "attn_backend='auto' or 'sdpa' instead, or run flex under torch.no_grad() for inference."
        )
    return backend


def build_context(backend: str, pe: PositionEncoding, q_len: int, k_len: int, device: torch.device) -> AttentionContext:
    """Masks and biases for one forward pass, shared by all layers."""
    if backend == "flex":
        offset = k_len - q_len

        def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(causal, None, None, q_len, k_len, device=device)
        return AttentionContext(backend, q_len, k_len, block_mask=block_mask, score_mod=pe.score_mod(q_len, k_len))
    bias = pe.score_bias(q_len, k_len, device)
    if bias is not None:
        bias = bias.masked_fill(~causal_mask(q_len, k_len, device), float("-inf"))
    return AttentionContext(backend, q_len, k_len, bias=bias)


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) bool, True where query i (at position k_len - q_len + i) may attend to key j."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    k_pos = torch.arange(k_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T / sqrt(D) + bias + causal mask) v, written out in (at least) float32: the reference.

    Args:
        q: (B, H, Tq, D) queries; k, v: (B, H, Tk, D) keys and values.
        bias: additive (H, Tq, Tk) score bias, or None.
        dropout_p: dropout on the attention weights.
        need_weights: also return the (B, H, Tq, Tk) attention weights (after dropout).

    Returns:
        The (B, H, Tq, D) output in q's dtype, and the weights or None.
    """
    q_len, k_len = q.size(-2), k.size(-2)
    dtype = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 if given float64
    scores = (q.to(dtype) @ k.to(dtype).transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    if bias is not None:
        scores = scores + bias.to(dtype)
    scores = scores.masked_fill(~causal_mask(q_len, k_len, q.device), float("-inf"))
    weights = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p)
    out = (weights @ v.to(dtype)).to(q.dtype)  # (B, H, Tq, D)
    return out, (weights if need_weights else None)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """PyTorch's fused scaled_dot_product_attention.

    Without a bias the call uses `is_causal=True` and no mask, which lets PyTorch pick its
    FlashAttention kernel on GPU. A bias (ALiBi) goes in as a float mask that already holds -inf on
    future keys; no flash kernel accepts one, so this path keeps a (H, Tq, Tk) tensor in memory.

    On a CPU, bf16 / fp16 inputs (under bf16 autocast) are attended in float32: the fused CPU
    kernel's bf16 forward + backward measured 1.1-4x slower than its float32 one up to 512 tokens
    (BENCHMARKS.md, "bf16 on the CPU"), while the matmuls around it run 2x faster in bf16.
    """
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        with torch.autocast("cpu", enabled=False):
            return _sdpa(q.float(), k.float(), v.float(), bias, dropout_p).to(q.dtype)
    return _sdpa(q, k, v, bias, dropout_p)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, dropout_p: float) -> Tensor:
    q_len, k_len = q.size(-2), k.size(-2)
    if bias is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout_p)
    if q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if q_len == 1:  # one new token attends to every cached key: no mask at all
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    mask = causal_mask(q_len, k_len, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


@functools.cache
def compiled_flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled once per process and shared by every layer and model.

    Compiling at first use (not at import) keeps `import model` cheap; without compilation
    flex_attention falls back to an unfused path that materializes the full score matrix.
    """
    return torch.compile(flex_attention)


def flex_attention_fused(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, score_mod: ScoreMod | None) -> Tensor:
    """FlexAttention: causal block mask plus an optional score_mod (ALiBi), fused in one kernel."""
    return compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask)


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dropout_p: float) -> Tensor:
    """Run the kernel `ctx.backend` names on (B, H, T, D) queries, keys and values."""
    if ctx.backend == "eager":
        return eager_attention(q, k, v, ctx.bias, dropout_p)[0]
    if ctx.backend == "sdpa":
        return sdpa_attention(q, k, v, ctx.bias, dropout_p)
    if ctx.backend == "flex":
        assert ctx.block_mask is not None, "build_context makes a block mask for flex"
        return flex_attention_fused(q, k, v, ctx.block_mask, ctx.score_mod)
    raise ValueError(f"Unknown attention backend {ctx.backend!r}; valid: eager, sdpa, flex.")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q/k/v projection, the position scheme's hooks,
    a kernel, and an output projection (the residual branch's last layer)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: Tensor, pe: PositionEncoding, ctx: AttentionContext, cache: LayerCache | None = None
    ) -> Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
            for t in self.qkv(x).split(C, dim=2)
        )
        q, k = pe.rotate(q, k, ctx.start)  # the new tokens, at their absolute positions
        if cache is not None:
            k, v = cache.update(k, v, ctx.start)  # (B, H, start + T, D): cached keys and the new ones
        y = attend(q, k, v, ctx, self.dropout if self.training else 0.0)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))
