"""Forgetting attention, the attention of the Forgetting Transformer (FoX; Lin et al., ICLR 2025; code
zhixuan-lin/forgetting-transformer `ForgettingAttentionLayer`): softmax attention whose scores decay with a
learned, data-dependent forget gate. Each head gates each token, f_t = sigmoid(w . x_t + b) from the layer
input, and with c_i = sum_{l<=i} ln f_l the score of key j for query i is q_i . k_j / sqrt(d) + c_i - c_j:
the gates of the tokens after the key, up to and with the query's own. Gate weights start at N(0, 0.02),
its bias at 0 (f about 0.5), as the official `fgate_proj`; the sums are float32, as its kernel asserts.

The term c_i - c_j is one layer's, one batch's: the layer hands its sums to the kernels as its plan's
`Term.TOKENS` (`model.terms`), which SDPA and eager add in row blocks with any scheme's bias, and flex in its
score_mod. Decoding keeps each key's c in the cache beside it; a new query's c is its predecessor's plus its own ln f.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posgpt.model.attention.base import wide
from posgpt.model.attention.softmax import SoftmaxAttention
from posgpt.model.cache import CacheWrite, KVCache, LayerCache
from posgpt.model.kernels import KERNELS, Plan
from posgpt.model.kernels.fla import FlaForgetting
from posgpt.model.positions import PositionEncoding
from posgpt.model.terms import Term, TokenTerms

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


class GateLayerCache(LayerCache):
    """One layer's keys and values, and beside them each key's gate sum c (held as one-wide float32 keys)."""

    def __init__(self, owner: KVCache) -> None:
        super().__init__(owner)
        self.sums = LayerCache(owner)

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        super().allocate(batch, dtype, device)
        self.sums.buffer(batch, self.owner.n_head, 1, torch.float32, device)  # per query head

    def gate_sums(self, c: Tensor, write: CacheWrite) -> tuple[Tensor, Tensor]:
        """The new tokens' sums (B, H, T), `c` (of their ln f) on from the cache's; the attended keys' (B, H, Tk)."""
        if not write.prefill:  # on from the token before: its c is in the cache
            assert self.sums.kv is not None
            slot = self.owner.slot_of(write.positions[:, :1] - 1)  # (B, 1)
            c = c + self.sums.kv[0][torch.arange(c.size(0), device=c.device)[:, None], :, slot, 0].transpose(1, 2)
        keys, _ = self.sums.update(c[..., None], c[..., None], write)  # (the values: a copy, as the store wants)
        return c, keys[..., 0]


class ForgettingAttention(SoftmaxAttention):
    """Forgetting attention (this module): softmax attention's layer and kernels, plus the forget gate."""

    layer_cache = GateLayerCache
    terms = frozenset({Term.TOKENS})
    kernels = {**KERNELS, "fla": FlaForgetting()}

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.fgate = nn.Linear(config.n_embd, config.n_head, bias=True)

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: GateLayerCache | None = None) -> Tensor:
        q, k, v = self.attended(x, pe, plan, cache)
        gate = self.fgate(x)
        log_f = F.logsigmoid(wide(gate)).transpose(1, 2)  # (B, H, T)
        c = log_f.cumsum(-1)
        c_q, c_k = cache.gate_sums(c, plan.cache_write) if cache is not None else (c, c.clone())  # two (`TokenTerms`)
        plan = dataclasses.replace(plan, tokens=TokenTerms(c_q, c_k))
        return self.output(self.attend(plan, q, k, v), x)
