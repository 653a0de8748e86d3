"""The gated delta rule's layers: Gated DeltaNet (GDN; Yang, Kautz, Hatamizadeh, ICLR 2025, arXiv 2412.06464; code
NVlabs/GatedDeltaNet `lit_gpt/gated_delta_net.py` and fla-org/flash-linear-attention `fla/layers/gated_deltanet.py`)
and Kimi Delta Attention (KDA; Kimi Linear, arXiv 2510.26692; fla `fla/layers/kda.py`).

Each head keeps a state S (d_k x d_v) that decays and is corrected towards each new key's value:

    S_t = diag(exp g_t) S_{t-1},   u_t = beta_t (v_t - S_t^T k_t),   S_t <- S_t + k_t u_t^T,   o_t = S_t^T q_t

with q and k L2-normalised (q also scaled by 1 / sqrt(d_k)), beta_t in (0, 1) (or (0, 2) with `delta_neg_eigval`)
and the log decay g_t <= 0 one per head (GDN) or one per key channel (KDA). The recurrent form above is the reference.
The chunked form takes chunks of 64 tokens: within a chunk, with G the chunk-local cumulative sum of g, the corrections
solve one unit lower-triangular system (the WY form: U = (I + A)^-1 (beta V - beta K e^G S_0), A_tj = beta_t
sum_c k_tc k_jc e^(G_tc - G_jc) for j < t), and the state passes from chunk to chunk. Every exponent is of a
difference G_t - G_j with j <= t (at most 0): KDA's per-channel pairs are formed through the position before each
block of rows for the keys of earlier blocks (fla's sub-chunking, here recursive: 64 rows in blocks of 16, those in
blocks of 4) and pair by pair within the smallest blocks, so nothing overflows however fast a channel decays.

Neither function scores pairs or reads positions: a short causal convolution (kernel 4) over q, k and v carries local
order, and the decay carries distance. Decoding keeps the convolution's last 3 inputs and S: constant in the length.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posgpt.core.errors import ConfigError
from posgpt.model.attention.base import Attention, wide
from posgpt.model.cache import CachePart, kept, static_buffer
from posgpt.model.kernels.base import WEIGHTS_CHUNK_ELEMENTS, Kernel, Plan
from posgpt.model.kernels.fla import FlaDelta
from posgpt.model.positions import SCHEMES
from posgpt.model.recompute import recomputed

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig
    from posgpt.model.masks import AttentionMask
    from posgpt.model.positions import PositionEncoding

CHUNK = 64
"""Tokens per chunk of the chunked form."""
BLOCK = 4
"""Rows per block in which KDA's per-channel decays of a chunk's pairs are formed pair by pair."""
SPLIT = 4
"""Blocks of rows a larger block of KDA's pairs is split into (64: 4 of 16, each 4 of 4)."""
SEGMENT = 64 * CHUNK
"""Tokens per segment of the chunked form: what a segment forms is held at once (recomputed in the backward pass)."""
CONV = 4
"""The short convolution's kernel size (both official codes')."""


def delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The reference, token by token: queries and keys (B, H, T, d_k) (normalised and scaled), values (B, H, T, d_v),
    beta (B, H, T), log decays g (B, H, T, d_k or 1), from `state` (B, H, d_k, d_v; None: zeros). Returns the outputs
    (B, H, T, d_v) and the state after the last token, in the inputs' dtype (float32 at least)."""
    q, k, v, beta, g = (wide(t) for t in (q, k, v, beta, g))
    B, H, T, d_k = k.shape
    S = state.to(k.dtype) if state is not None else k.new_zeros(B, H, d_k, v.size(-1))
    outputs = []
    for t in range(T):
        S = S * g[:, :, t, :, None].exp()
        k_t = k[:, :, t, :, None]  # (B, H, d_k, 1)
        u = beta[:, :, t, None] * (v[:, :, t] - (k_t * S).sum(-2))  # (B, H, d_v)
        S = S + k_t * u[:, :, None, :]
        outputs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outputs, dim=2), S


def decayed_products(x: Tensor, y: Tensor, G: Tensor) -> Tensor:
    """M_tj = sum_c x_tc y_jc exp(G_tc - G_jc) for the pairs j <= t of each chunk, 0 elsewhere: x (E..., C, d)
    (several stacked in front, E, share the decays), y (..., C, d), G (..., C, d or 1) non-increasing along C;
    (E..., C, C)."""
    C = x.size(-2)
    rows = torch.arange(C, device=x.device)
    keep = rows[None, :] <= rows[:, None]
    if G.size(-1) == 1:  # one decay per head (GDN): a (C, C) factor
        G = G[..., 0]
        return (x @ y.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).masked_fill(~keep, -math.inf).exp()
    if C <= BLOCK or C % SPLIT:  # per channel (KDA), a small block: every pair's decays, (..., C, C, d)
        decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep[..., None], -math.inf).exp()
        return (x[..., :, None, :] * (y[..., None, :, :] * decay)).sum(-1)
    size = C // SPLIT  # else SPLIT blocks of rows: those on the diagonal as blocks of their own (recursively), ...
    diagonal = decayed_products(*(t.unflatten(-2, (SPLIT, size)) for t in (x, y, G)))
    blocks = []
    for b in range(SPLIT):  # ... the keys of earlier blocks through G at the position before the block: factors <= 1
        start, end = b * size, (b + 1) * size
        left = []
        if b:
            ref = G[..., start - 1 : start, :]
            xq = x[..., start:end, :] * (G[..., start:end, :] - ref).exp()
            left = [xq @ (y[..., :start, :] * (ref - G[..., :start, :]).exp()).transpose(-1, -2)]
        right = x.new_zeros(*x.shape[:-2], size, C - end)
        blocks.append(torch.cat([*left, diagonal[..., b, :, :], right], dim=-1))
    return torch.cat(blocks, dim=-2)


def delta_rule_chunked(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None = None, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """The chunked form of `delta_rule_recurrent` (same arguments and results). Padding the length to whole chunks
    changes nothing: a padded token has k = v = 0, beta = 0 and g = 0."""
    q, k, v, beta, g = (wide(t) for t in (q, k, v, beta, g))
    B, H, T, d_k = k.shape
    pad = -T % chunk
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    q, k, v, g = (t.unflatten(2, (-1, chunk)) for t in (q, k, v, g))  # (B, H, N, C, d)
    beta = beta.unflatten(2, (-1, chunk))[..., None]
    G = g.cumsum(-2)
    # A (its diagonal unread: the solve takes I's) and the outputs' pairs P, with one set of decays
    A, P = decayed_products(torch.stack([beta * k, q]), k, G).unbind(0)
    rhs = torch.cat([beta * k * G.exp(), beta * v], dim=-1)  # (I + A) [W U] = rhs, A strictly below the diagonal
    W, U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([d_k, v.size(-1)], dim=-1)
    # with S the state at a chunk's start: its corrections U - W S, its outputs q e^G S + P (U - W S), and the next
    # chunk's state e^G_last S + k_rest^T (U - W S). All but one product per chunk are formed for every chunk at once:
    k_rest = (k * (G[..., -1:, :] - G).exp()).transpose(-1, -2)
    moves, inputs = k_rest @ W, k_rest @ U  # S_next = e^G_last S - moves S + inputs
    decays = G[..., -1, :].exp()[..., None]
    S = state.to(k.dtype) if state is not None else k.new_zeros(B, H, d_k, v.size(-1))
    starts = []
    # N first and contiguous, unbound once (its backward stacks: indexing in the loop would give each chunk's
    # backward a gradient of the whole length, O(T^2 / C) in all)
    for decay, move, add in zip(
        *(t.movedim(2, 0).contiguous().unbind(0) for t in (decays, moves, inputs)), strict=True
    ):
        starts.append(S)
        S = decay * S - move @ S + add
    out = P @ U + (q * G.exp() - P @ W) @ torch.stack(starts, dim=2)
    return out.flatten(2, 3)[:, :, :T], S


def l2_normalized(x: Tensor) -> Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dimension, as both official codes' l2norm."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


class DeltaRecurrent(Kernel):
    """The recurrent form, token by token: the reference, which forms the maps' weights (`implicit_weights`)."""

    weights = True
    rule = staticmethod(delta_rule_recurrent)


class DeltaChunked(Kernel):
    """The chunked form (chunks of 64, the WY form within a chunk): the same outputs, in parallel within chunks, over
    segments of SEGMENT tokens, the state passed from one to the next. With gradients, each segment is recomputed in
    the backward pass, as fla's kernels recompute their chunks: only its inputs are kept, and the blocks it forms (64
    x 64 per chunk, KDA's per channel) are held for one segment at a time, whatever the length."""

    @staticmethod
    def rule(
        q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None = None, segment: int = SEGMENT
    ) -> tuple[Tensor, Tensor]:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, beta, g))
        outputs = []
        for start in range(0, k.size(2), segment):
            part = [t[:, :, start : start + segment] for t in (q, k, v, beta, g)]
            out, state = recomputed(delta_rule_chunked, *part, state) if grad else delta_rule_chunked(*part, state)
            outputs.append(out)
        assert state is not None
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)), state  # one segment: no copy


def implicit_weights(q: Tensor, k: Tensor, beta: Tensor, g: Tensor) -> Tensor:
    """The (B, H, T, T) matrix A with o = A v: the recurrent form run on the values' basis vectors (each state row
    holds the coefficients of the values in it). Lower-triangular; not a distribution (it may be negative)."""
    B, H, T, _ = k.shape
    basis = torch.eye(T, dtype=torch.promote_types(k.dtype, torch.float32), device=k.device).expand(B, H, T, T)
    return delta_rule_recurrent(q, k, basis, beta, g)[0]


class DeltaLayerCache:
    """What decoding keeps of one layer: the short convolution's last CONV - 1 inputs (B, CONV - 1, channels) and
    the state S (B, H, d_k, d_v) in float32, of constant size, updated in place once allocated."""

    def __init__(self, n_head: int, d_k: int, d_v: int, channels: int) -> None:
        self.shape = (n_head, d_k, d_v, channels)
        self.conv: Tensor | None = None
        self.state: Tensor | None = None

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        H, d_k, d_v, channels = self.shape
        self.conv = static_buffer(torch.zeros(batch, CONV - 1, channels, dtype=dtype, device=device))
        self.state = static_buffer(torch.zeros(batch, H, d_k, d_v, device=device))


class DeltaAttention(Attention):
    """A gated delta rule layer (this module): its own projections, short convolutions, gates and output norm, none
    of the pair-scoring layers' (no scheme acting in attention, no mask, no QK-norm, gate, sinks or soft-cap)."""

    kernels = {"eager": DeltaRecurrent(), "chunked": DeltaChunked(), "fla": FlaDelta()}
    drops_weights = False
    scored = False
    takes_positions = False

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        nn.Module.__init__(self)  # none of Attention's projections: its own, below
        C, H = config.n_embd, config.n_head
        self.n_head, (self.d_k, self.d_v) = H, self.head_sizes(config)
        key_dim, value_dim = H * self.d_k, H * self.d_v
        self.q_proj, self.k_proj = nn.Linear(C, key_dim, bias=False), nn.Linear(C, key_dim, bias=False)
        self.v_proj = nn.Linear(C, value_dim, bias=False)
        channels = 2 * key_dim + value_dim  # q, k and v: depthwise, each channel its own filter
        self.conv = nn.Conv1d(channels, channels, CONV, groups=channels, bias=False)
        self.o_norm = nn.RMSNorm(self.d_v, eps=1e-5)
        self.proj = nn.Linear(value_dim, C, bias=False)  # `proj`: the residual branch's output (GPT.init_weights)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.neg_eigval = config.delta_neg_eigval
        self.sinks = None

    @classmethod
    def head_sizes(cls, config: GPTConfig) -> tuple[int, int]:
        """(d_k, d_v) of each head."""
        raise NotImplementedError

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        widths = {"gated_deltanet": (config.gdn_expand_k, config.gdn_expand_v), "kda": (1.0, config.kda_expand_v)}
        d_k, d_v = (config.n_embd * expand for expand in widths[config.attention])
        name = f"attention={config.attention!r}"
        scheme = SCHEMES[config.pos_encoding]
        off = {f: config.__dataclass_fields__[f].default for f in ("qk_norm", "attn_gate", "attn_sink_logits",
               "attn_softcap", "attn_window", "attn_chunk", "n_kv_head")}  # fmt: skip
        refusals = {
            f"{name} has no pair scores for pos_encoding={config.pos_encoding!r} to act on (its short convolution and "
            "decay carry order): use pos_encoding 'none', or a scheme that acts on the embeddings (learned, "
            "sinusoidal).": not scheme.embeds and scheme.uses_positions,
            f"{name} sets its own key and value widths: n_head {config.n_head} must split keys {d_k:g} and values "
            f"{d_v:g} wide into whole heads (change n_head, n_embd or the expansions).": 0 in cls.head_sizes(config),
            **{f"GPTConfig.{f} belongs to the layers that score pairs, which {name} does not: leave it at "
               f"{value!r}.": getattr(config, f) != value for f, value in off.items()},
        }  # fmt: skip
        for message, applies in refusals.items():
            if applies:
                raise ConfigError(message)

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: DeltaLayerCache | None = None) -> Tensor:
        B, T, _ = x.shape
        H, d_k = self.n_head, self.d_k
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (B, T, channels)
        write = plan.cache_write if cache is not None else None
        before = cache.conv if write is not None and not write.prefill and cache.conv is not None else None
        inputs = torch.cat([before if before is not None else mixed.new_zeros(B, CONV - 1, mixed.size(-1)), mixed], 1)
        convolved = F.silu(self.conv(inputs.transpose(1, 2)).transpose(1, 2))  # causal: CONV - 1 inputs before each
        q, k, v = convolved.split([H * d_k, H * d_k, H * self.d_v], dim=-1)
        q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in (q, k, v))
        q, k, v = (wide(t) for t in (q, k, v))
        q, k = l2_normalized(q) / math.sqrt(d_k), l2_normalized(k)
        beta, g = self.gates(x)  # (B, H, T), (B, H, T, d_k or 1)
        beta = beta * 2 if self.neg_eigval else beta
        if write is not None and write.real is not None:  # padding: no correction, no decay
            real = write.real[:, None, :]
            k, v, beta, g = k * real[..., None], v * real[..., None], beta * real, g * real[..., None]
        state = cache.state if write is not None and not write.prefill else None
        rule = delta_rule_recurrent if write is not None and T == 1 else plan.kernel.rule  # type: ignore[attr-defined]
        with torch.autocast(x.device.type, enabled=False):  # the state in float32 at least, as fla's kernels keep it
            y, final = rule(q, k, v, beta, g, state)
            weights = implicit_weights(q, k, beta, g) if plan.on_weights is not None else None
        if weights is not None:  # the maps: o = A v, handed over in blocks of query rows
            step = max(1, WEIGHTS_CHUNK_ELEMENTS // (B * H * T))
            for start in range(0, T, step):
                rows = slice(start, min(start + step, T))
                plan.on_weights(rows, weights[:, :, rows].float())
        if write is not None:
            assert cache is not None
            ends = write.real.sum(-1) if write.real is not None else torch.full((B,), T, device=x.device)
            index = ends[:, None] + torch.arange(CONV - 1, device=x.device)  # each row's last inputs, at its end
            cache.conv = kept(cache.conv, inputs.gather(1, index[..., None].expand(-1, -1, inputs.size(-1))))
            cache.state = kept(cache.state, final)
        y = self.o_norm(y.transpose(1, 2)) * self.gate(x).view(B, T, H, self.d_v).to(y.dtype)  # (B, T, H, d_v)
        return self.resid_dropout(self.proj(y.flatten(2).to(x.dtype)))

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """beta (B, H, T) and the log decay g (B, H, T, d_k or 1), in float32 at least."""
        raise NotImplementedError

    def gate(self, x: Tensor) -> Tensor:
        """The output gate's activation (B, T, value dim)."""
        raise NotImplementedError

    @classmethod
    def mixing_flops(cls, config: GPTConfig, mask: AttentionMask, seq_len: int) -> int:
        """The recurrent form's three products a token and head (S^T k, k u^T, S^T q: 2 d_k d_v each), forward and
        backward: 18 H d_k d_v, whatever the length."""
        d_k, d_v = cls.head_sizes(config)
        return 18 * config.n_head * d_k * d_v

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int, layers: int) -> CachePart:
        d_k, d_v = cls.head_sizes(config)
        H = config.n_head
        return CachePart([DeltaLayerCache(H, d_k, d_v, H * (2 * d_k + d_v)) for _ in range(layers)])

    @classmethod
    def constant_memory(cls, config: GPTConfig, mask: AttentionMask) -> bool:
        return True


class GatedDeltaNet(DeltaAttention):
    """Gated DeltaNet: one decay per head, g = -exp(A_log) softplus(W_a x + dt_bias); beta = sigmoid(W_b x); the
    output RMS-normed per head times SiLU(W_g x). Keys `gdn_expand_k` x n_embd wide, values `gdn_expand_v` x n_embd
    (NVlabs' 0.75 and 1.5). Where the official codes differ, NVlabs': W_b has a bias (fla's has none)."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        C, H = config.n_embd, config.n_head
        self.a_proj = nn.Linear(C, H, bias=False)
        self.b_proj = nn.Linear(C, H, bias=True)
        self.g_proj = nn.Linear(C, H * self.d_v, bias=False)
        self.A_log = nn.Parameter(torch.empty(H).uniform_(0, 16).log())
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    @classmethod
    def head_sizes(cls, config: GPTConfig) -> tuple[int, int]:
        key_dim, value_dim = (config.n_embd * e for e in (config.gdn_expand_k, config.gdn_expand_v))
        whole = all(float(d).is_integer() and int(d) % config.n_head == 0 for d in (key_dim, value_dim))
        return (int(key_dim) // config.n_head, int(value_dim) // config.n_head) if whole else (0, 0)

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        beta = torch.sigmoid(wide(self.b_proj(x))).transpose(1, 2)
        g = -wide(self.A_log).exp() * F.softplus(wide(self.a_proj(x)) + wide(self.dt_bias))
        return beta, g.transpose(1, 2)[..., None]

    def gate(self, x: Tensor) -> Tensor:
        return F.silu(self.g_proj(x))


class KimiDeltaAttention(DeltaAttention):
    """KDA: one decay per key channel, g = -exp(A_log[h]) softplus(W_f x + dt_bias) with W_f low-rank (n_embd ->
    d_v -> keys), beta = sigmoid(W_b x); the output RMS-normed per head times sigmoid(W_g x), W_g low-rank with a
    bias on its second linear. Heads n_embd / n_head wide for keys, `kda_expand_v` times that for values (fla's)."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        C, H = config.n_embd, config.n_head
        self.f_proj = nn.Sequential(nn.Linear(C, self.d_v, bias=False), nn.Linear(self.d_v, H * self.d_k, bias=False))
        self.b_proj = nn.Linear(C, H, bias=False)
        self.g_proj = nn.Sequential(nn.Linear(C, self.d_v, bias=False), nn.Linear(self.d_v, H * self.d_v, bias=True))
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.zeros(H * self.d_k))

    @classmethod
    def head_sizes(cls, config: GPTConfig) -> tuple[int, int]:
        d_v = config.head_dim * config.kda_expand_v
        return (config.head_dim, int(d_v)) if float(d_v).is_integer() and d_v >= 1 else (0, 0)

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, _ = x.shape
        beta = torch.sigmoid(wide(self.b_proj(x))).transpose(1, 2)
        f = (wide(self.f_proj(x)) + wide(self.dt_bias)).view(B, T, self.n_head, self.d_k)
        g = -wide(self.A_log).exp()[:, None] * F.softplus(f)
        return beta, g.transpose(1, 2)

    def gate(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.g_proj(x))
