"""Causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"), phi(x) = elu(x) + 1:

    out_i = phi(q_i)^T S_i / phi(q_i)^T z_i,   S_i = sum_{j<=i} phi(k_j) v_j^T,   z_i = sum_{j<=i} phi(k_j)

With RoPE the rotation goes into the numerator only (RoFormer section 3.3), so the kernels take
q2 = [R phi(q), phi(q)] and k2 = [R phi(k), phi(k)]. The quadratic form is the reference; the chunked
form (running sums across chunks) trains and, one token at a time with its state kept, decodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from posgpt.model.attention.base import Attention, wide
from posgpt.model.cache import CachePart, CacheWrite, kept, static_buffer
from posgpt.model.kernels.base import WEIGHTS_CHUNK_ELEMENTS, Kernel, Plan, WeightsHook
from posgpt.model.scores import Score

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig
    from posgpt.model.masks import AttentionMask
    from posgpt.model.positions import PositionEncoding

CHUNK = 64
"""Queries per chunk of the chunked form."""


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1, in (at least) float32."""
    return F.elu(wide(x)) + 1.0


class LinearState(NamedTuple):
    """The running sums after some tokens: S (B, H, D, D) and z (B, H, D)."""

    S: Tensor
    z: Tensor


def linear_attention_quadratic(q2: Tensor, k2: Tensor, v: Tensor, on_weights: WeightsHook | None = None) -> Tensor:
    """The reference: the masked (T, T) numerator and denominator written out, in (at least) float32;
    with `on_weights`, in chunks of queries, each chunk's normalised kernel products handed to it."""
    rq, fq = wide(q2).chunk(2, dim=-1)  # rotated features, plain features
    rk, fk = wide(k2).chunk(2, dim=-1)
    B, H, T, _ = rq.shape
    step = T if on_weights is None else max(1, WEIGHTS_CHUNK_ELEMENTS // (B * H * T))
    k_pos = torch.arange(T, device=q2.device)
    outs = []
    for c in range(0, T, step):
        rows = slice(c, min(c + step, T))
        causal = k_pos[None, :] <= k_pos[rows, None]  # (rows, T)
        numerator = (rq[:, :, rows] @ rk.transpose(-2, -1)).masked_fill(~causal, 0.0)  # (B, H, rows, T)
        denominator = (fq[:, :, rows] @ fk.transpose(-2, -1)).masked_fill(~causal, 0.0).sum(-1, keepdim=True)
        weights = numerator / denominator
        if on_weights is not None:
            on_weights(rows, weights)
        outs.append(weights @ wide(v))  # (B, H, rows, D)
    return torch.cat(outs, dim=2).to(v.dtype)


def linear_attention_chunked(
    q2: Tensor, k2: Tensor, v: Tensor, state: LinearState | None = None, chunk: int = CHUNK
) -> tuple[Tensor, LinearState]:
    """The chunked form, continuing from `state` (None: from the start); the output and the state after it."""
    rq, fq = wide(q2).chunk(2, dim=-1)
    rk, fk = wide(k2).chunk(2, dim=-1)
    vf = wide(v)
    B, H, _, D = rq.shape
    if state is None:
        state = LinearState(rq.new_zeros(B, H, D, vf.size(-1)), rq.new_zeros(B, H, D))
    S, z = state
    outputs = []
    # split once (its backward concatenates): slicing inside the loop would make each slice's
    # backward allocate a gradient of the full length, O(T^2 / C) in all
    for rq_c, fq_c, rk_c, fk_c, v_c in zip(*(x.split(chunk, dim=2) for x in (rq, fq, rk, fk, vf)), strict=True):
        n = rq_c.size(2)
        causal = torch.ones(n, n, dtype=torch.bool, device=q2.device).tril()
        scores = (rq_c @ rk_c.transpose(-2, -1)).masked_fill(~causal, 0.0)
        weights = (fq_c @ fk_c.transpose(-2, -1)).masked_fill(~causal, 0.0)
        numerator = scores @ v_c + rq_c @ S  # within the chunk + every earlier chunk
        denominator = weights.sum(-1) + (fq_c @ z[..., None]).squeeze(-1)
        outputs.append(numerator / denominator[..., None])
        S = S + rk_c.transpose(-2, -1) @ v_c
        z = z + fk_c.sum(-2)
    return torch.cat(outputs, dim=2).to(v.dtype), LinearState(S, z)


class LinearReference(Kernel):
    """The quadratic form: the reference, which forms the weights (attention maps)."""

    weights = True

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        return linear_attention_quadratic(q, k, v, on_weights=plan.on_weights)


class LinearChunked(Kernel):
    """Linear attention's chunked form: O(T) time and memory."""

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        return linear_attention_chunked(q, k, v)[0]


class LayerStateCache:
    """What decoding keeps of one layer of linear attention: its running sums, of constant size, updated in place
    once allocated (a compiled step keeps its tensors)."""

    def __init__(self, n_head: int, head_dim: int) -> None:
        self.n_head, self.head_dim = n_head, head_dim
        self.state: LinearState | None = None

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """The sums per query head (`LinearAttention.forward` repeats each KV head into its group)."""
        H, D = self.n_head, self.head_dim
        S = torch.zeros(batch, H, D, D, device=device)
        self.state = LinearState(static_buffer(S), static_buffer(torch.zeros(batch, H, D, device=device)))

    def attend(self, q2: Tensor, k2: Tensor, v: Tensor, write: CacheWrite) -> Tensor:
        """The new tokens' outputs, continuing from the state (from zero in a prefill, padding zeroed out)."""
        if write.real is not None:
            k2, v = (t * write.real[:, None, :, None] for t in (k2, v))
        out, new = linear_attention_chunked(q2, k2, v, None if write.prefill else self.state)
        held = self.state if self.state is not None else (None, None)
        self.state = LinearState(*(kept(h, value) for h, value in zip(held, new, strict=True)))
        return out


class LinearAttention(Attention):
    """Causal linear attention (this module): no weights to drop, no scoring function, no score bias or window."""

    kernels = {"eager": LinearReference(), "chunked": LinearChunked()}  # causal by construction: no mask or bias
    drops_weights = False
    scored = False

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerStateCache | None = None) -> Tensor:
        q, k, v = self.project(x)
        fq, fk = feature_map(q), feature_map(k)
        rq, rk = pe.rotate(fq, fk, plan.placement.positions, plan.placement.rotation)
        q2, k2 = torch.cat([rq, fq], dim=-1), torch.cat([rk, fk], dim=-1)
        if cache is not None:  # running sums per query head: KV head h // (H / H_kv) read into each
            k2, v = (t.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for t in (k2, v))
        y = cache.attend(q2, k2, v, plan.cache_write) if cache is not None else self.attend(plan, q2, k2, v)
        return self.output(y, x)

    @classmethod
    def mixing_flops(cls, config: GPTConfig, mask: AttentionMask, seq_len: int) -> int:
        """The state's two products a token and head (S += phi(k) v^T, phi(q)^T S: 2 D^2 each), forward and backward:
        12 C D, whatever the length."""
        return 12 * config.n_embd * config.head_dim

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int, layers: int) -> CachePart:
        return CachePart([LayerStateCache(config.n_head, config.head_dim) for _ in range(layers)])

    @classmethod
    def constant_memory(cls, config: GPTConfig, mask: AttentionMask) -> bool:
        return True
