"""Softmax attention's layer (Vaswani et al. 2017), on the kernels of `model.kernels`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from posgpt.model.attention.base import Attention
from posgpt.model.cache import CachePart, KVCache, LayerCache
from posgpt.model.kernels import KERNELS, Plan
from posgpt.model.masks import AttentionMask
from posgpt.model.positions import SCHEMES, PositionEncoding
from posgpt.model.scores import LogLengthScale
from posgpt.model.terms import Term

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


class SoftmaxAttention(Attention):
    """Multi-head causal softmax attention; decoding keeps a KV cache shaped by the mask."""

    kernels = KERNELS

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.log_scale = LogLengthScale.of(config)
        self.reconfigure(config, config)  # the mask and Llama 4's query scale (the log-length scale: as built)

    def reconfigure(self, old: GPTConfig, config: GPTConfig) -> None:
        self.mask = AttentionMask.of(config)
        self.temperature_floor = config.attn_temperature_floor
        if _log_scaling_changes(old, config):
            scale = LogLengthScale.of(config)
            weight = self.qkv.weight
            self.log_scale = scale.to(device=weight.device, dtype=weight.dtype) if scale is not None else None

    def reconfigure_replaces_parameters(self, old: GPTConfig, config: GPTConfig) -> bool:
        return _log_scaling_changes(old, config) and "learned" in (old.attn_log_scaling, config.attn_log_scaling)

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerCache | None = None) -> Tensor:
        q, k, v = self.attended(x, pe, plan, cache)
        return self.output(self.attend(plan, q, k, v), x)

    def attended(
        self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The new tokens' queries (scored, rotated, QK-normed, log-length scaled) and the keys and values they
        attend over (rotated, QK-normed, with the cache's)."""
        q, k, v = self.project(x)
        q = self.score.queries(q)  # what the kernels score, rotated like q
        q, k = self.rotate(pe, q, k, plan.placement)
        if self.norm_rotated and pe.rotates:  # a QK-norm after the rotation, on rotating layers only (Llama 4's)
            q, k = self.qk_norm(q, k)
        if cache is not None:
            k, v = cache.update(k, v, plan.cache_write)  # the keys and values the plan describes
        if self.log_scale is None and not self.temperature_floor:
            return q, k, v
        place = plan.placement  # the queries stand at their cache positions when decoding, else at 0..Tq-1
        order = place.positions if place.k_pos is not None else torch.arange(place.q_len, device=place.device)
        if self.log_scale is not None:  # the keys each sees: by the mask, on token order
            q = self.log_scale(q, self.mask.seen_keys(order))
        if self.temperature_floor:  # by position: the scheme's (random positions too)
            wide = torch.promote_types(q.dtype, torch.float32)
            scale = temperature(place.positions if place.positions is not None else order, self.temperature_floor, wide)
            q = (q * (scale[:, None, :, None] if scale.dim() == 2 else scale[:, None])).to(q.dtype)  # (B?, 1, Tq, 1)
        return q, k, v

    layer_cache: ClassVar[type[LayerCache]] = LayerCache
    """A layer's store in the KV cache: keys and values (forgetting attention: each key's gate sum too)."""
    keys_in_order: ClassVar[bool] = False
    """Its weights run over the keys in position order (stick-breaking's product): the KV cache never rolls."""

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int, layers: int) -> CachePart:
        rolls = cls.constant_memory(config, mask)  # else no mask: never rolled
        return KVCache(layers, capacity, config.kv_heads, config.head_dim, config.n_head, mask if rolls else None,
                       cls.layer_cache)  # fmt: skip

    @classmethod
    def constant_memory(cls, config: GPTConfig, mask: AttentionMask) -> bool:
        """Whether the KV cache rolls (a window's), unless the weights read the keys in order (CoPE counts them)."""
        return mask.rolling and not (cls.keys_in_order or Term.FROM_SCORES in SCHEMES[config.pos_encoding].terms)


def temperature(positions: Tensor, floor: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Llama 4's query scale at 0-based `positions`, log(floor((p + 1) / F) + 1) 0.1 + 1 (its `attn_scale` 0.1,
    `floor_scale` F), in `dtype`: 1 until p + 1 reaches F, then growing with the log of the number of whole F's."""
    return torch.log(torch.div(positions + 1, floor, rounding_mode="floor").to(dtype) + 1) * 0.1 + 1.0


def _log_scaling_changes(old: GPTConfig, new: GPTConfig) -> bool:
    return (old.attn_log_scaling, old.attn_log_scale) != (new.attn_log_scaling, new.attn_log_scale)
