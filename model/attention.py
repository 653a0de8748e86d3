"""Causal self-attention: the layer, and the per-forward context (masks, biases, block masks)
that every layer shares. The kernels that compute attention, and how one is chosen, are in
`model.kernels`.

Positions are absolute: the Tq queries sit at q_start.., the Tk keys at `k_pos` (0..Tk-1 in a
plain forward; a rolling KV cache holds other positions).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from model.cache import LayerCache
from model.config import GPTConfig
from model.kernels import AttentionContext, Kernel, ScoreMod, compiled_create_block_mask
from model.linear_attention import LayerStateCache, feature_map
from model.masks import AttentionMask
from model.positions import PositionEncoding
from model.scores import build_score


def build_context(
    kernel: Kernel,
    pe: PositionEncoding,
    mask: AttentionMask,
    n_head: int,
    q_start: int,
    q_len: int,
    k_pos: Tensor | None,
    device: torch.device,
    block_masks: dict | None = None,
    ids: Tensor | None = None,
) -> AttentionContext:
    """Masks and biases for one forward pass, shared by all layers. `k_pos` holds the keys' absolute
    positions (None: 0..q_start + q_len - 1; a rolling cache marks empty slots with -1). `ids`
    (B, T): each row's own positions (randomized positions, no cache), which the position scheme
    sees; the mask stays on token order (the ids increase along a row)."""
    k_len = k_pos.numel() if k_pos is not None else q_start + q_len
    if kernel.function == "linear":  # causal by construction: no mask, no bias
        return AttentionContext(kernel, q_start, q_len, k_len, ids=ids)
    if kernel.name == "flex":
        return AttentionContext(
            kernel,
            q_start,
            q_len,
            k_len,
            block_mask=build_block_mask(mask, q_start, q_len, k_pos, device, block_masks),
            score_mod=_score_mod(pe, q_start, k_pos, ids) if pe.bias_kind else None,
            ids=ids,
        )
    q_pos = torch.arange(q_start, q_start + q_len, device=device)
    keys = k_pos if k_pos is not None else torch.arange(k_len, device=device)
    plain = mask.causal_only and k_pos is None  # SDPA's own causal shortcuts apply
    visible = None if plain and kernel.name != "eager" else _visible(mask, q_pos, keys)
    bias = None
    if pe.bias_kind:
        heads = torch.arange(n_head, device=device)[:, None, None]
        if ids is None:
            distance = (q_pos[:, None] - keys[None, :])[None]  # (1, Tq, Tk)
        else:
            distance = (ids[:, :, None] - ids[:, None, :])[:, None]  # (B, 1, T, T)
        bias = pe.relative_bias(heads, distance)  # (H, Tq, Tk) or (B, H, T, T): the formula written once
        bias = bias.masked_fill(~(visible if visible is not None else _visible(mask, q_pos, keys)), float("-inf"))
    return AttentionContext(kernel, q_start, q_len, k_len, mask=visible, bias=bias, ids=ids)


def _visible(mask: AttentionMask, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    return mask.dense(q_pos, k_pos) & (k_pos >= 0)[None, :]


def _score_mod(pe: PositionEncoding, q_start: int, k_pos: Tensor | None, ids: Tensor | None = None) -> ScoreMod:
    """The scheme's bias as a FlexAttention score_mod: the same `relative_bias` as the dense path."""
    if ids is not None:

        def score_mod_ids(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + pe.relative_bias(h, ids[b, q_idx] - ids[b, kv_idx])

        return score_mod_ids

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        k = kv_idx if k_pos is None else k_pos[kv_idx]
        return score + pe.relative_bias(h, q_idx + q_start - k)

    return score_mod


def build_block_mask(
    mask: AttentionMask, q_start: int, q_len: int, k_pos: Tensor | None, device: torch.device, cache: dict | None
) -> BlockMask:
    """The block mask of `mask`, built once per shape and reused (in `cache`) by later forwards: on
    CUDA through a compiled `create_block_mask`, which never materialises the dense Tq x Tk mask."""
    key = (mask, q_start, q_len, None if k_pos is None else tuple(k_pos.tolist()), str(device))
    if cache is not None and key in cache:
        return cache[key]
    if k_pos is None:
        mask_mod = mask.mask_mod(q_start)
    else:

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            k = k_pos[kv_idx]
            return mask.visible(q_idx + q_start, k) & (k >= 0)

    k_len = k_pos.numel() if k_pos is not None else q_start + q_len
    build = compiled_create_block_mask() if device.type == "cuda" else create_block_mask
    block_mask = build(mask_mod, None, None, q_len, k_len, device=device)
    if cache is not None:
        if len(cache) > 8:  # a handful of shapes per model (training, evaluation lengths)
            cache.clear()
        cache[key] = block_mask
    return block_mask


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
        self.linear = config.attention == "linear"
        self.score = build_score(config)

    def forward(
        self,
        x: Tensor,
        pe: PositionEncoding,
        ctx: AttentionContext,
        cache: LayerCache | LayerStateCache | None = None,
    ) -> Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
            for t in self.qkv(x).split(C, dim=2)
        )
        if self.linear:
            y = self._linear(q, k, v, pe, ctx, cache)
        else:
            q, k = pe.rotate(q, k, ctx.q_start, ctx.ids)  # the new tokens, at their absolute positions
            if isinstance(cache, LayerCache):
                k, v = cache.update(k, v, ctx.q_start)  # the keys and values `ctx` describes
            y = ctx.kernel.run(q, k, v, ctx, self.dropout if self.training else 0.0, self.score)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))

    def _linear(
        self, q: Tensor, k: Tensor, v: Tensor, pe: PositionEncoding, ctx: AttentionContext, cache: object
    ) -> Tensor:
        """Linear attention: features phi(q), phi(k); the scheme's rotation on them for the numerator
        only (RoFormer); with a state cache, the recurrent form."""
        fq, fk = feature_map(q), feature_map(k)
        rq, rk = pe.rotate(fq, fk, ctx.q_start, ctx.ids)
        q2, k2 = torch.cat([rq, fq], dim=-1), torch.cat([rk, fk], dim=-1)
        if isinstance(cache, LayerStateCache):
            return cache.attend(q2, k2, v)
        return ctx.kernel.run(q2, k2, v, ctx, 0.0, self.score)
