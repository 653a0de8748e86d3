"""The attention layers, one class per attention function, and their registry `ATTENTIONS`.

A layer projects its input to queries, keys and values, applies the position scheme, and hands
them to the forward pass's `Plan` (a kernel and the context it built once for every layer); it
never asks which kernel it has. The layer class also declares what the function is: its kernels
(each function has its own registry of them), whether attention dropout and a scoring function
apply to it, what decoding keeps (`new_cache`) and whether that stays the same size however long
decoding runs (`constant_memory`). Adding an attention function is one layer class (usually with a
kernel class of its own) and one line in `ATTENTIONS`: see docs/extending.md. What the registries
allow together is checked in `model.validation`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from core.errors import ConfigError
from model.cache import KVCache, LayerCache
from model.kernels import KERNELS, Kernel, Needs, Plan, Step, WeightsHook, choose_kernel, weights_kernel
from model.linear_attention import LINEAR_KERNELS, LayerStateCache, StateCache, feature_map
from model.masks import AttentionMask
from model.positions import PositionEncoding, ScoreBias
from model.scores import SCORES, LogLengthScale, Score, build_score
from model.sigmoid_attention import SIGMOID_KERNELS, sigmoid_length

if TYPE_CHECKING:
    from model.config import GPTConfig

Cache = KVCache | StateCache


class Attention(nn.Module):
    """Base of the attention layers: the fused q/k/v projection, the output projection (the residual
    branch's last layer) and its dropout, the scoring function; and, as class-level declarations, what
    the attention function is."""

    kernels: ClassVar[Mapping[str, Kernel]]
    """This function's kernels by `attn_backend` name."""
    drops_weights: ClassVar[bool] = True
    """Attention dropout (`config.dropout`) applies to its weights."""
    scored: ClassVar[bool] = True
    """It scores query-key pairs with `config.attn_score`."""
    value_passes: ClassVar[int] = 1
    """Weighted sums of the values per query (the FLOP count's): two for differential attention."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        """This layer's index in the model, from 0."""
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.score = build_score(config)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> queries, keys, values, (B, H, T, D) each."""
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        return q, k, v

    def output(self, y: Tensor) -> Tensor:
        """(B, H, T, D) attention output -> (B, T, C) residual branch."""
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.proj(y))

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        """Raise `ConfigError` when the function cannot work with `config` (called at its validation)."""

    @classmethod
    def kernel_head_size(cls, head_dim: int) -> int:
        """The head size of the queries and keys its kernels see (some kernels need a minimum)."""
        return head_dim

    @classmethod
    def rotary_dim(cls, config: GPTConfig) -> int:
        """The width of the vectors the position scheme rotates as one (`rotate`): a head's."""
        return config.head_dim

    @classmethod
    def kernel_context(
        cls, kernel: Kernel, config: GPTConfig, bias: ScoreBias | None, mask: AttentionMask, step: Step, memo: dict
    ) -> Any:
        """What `kernel` needs for one forward pass of a model of `config` (`Kernel.context`); a function
        with settings of its own hands them to its kernels here."""
        return kernel.context(bias, mask, step, memo)

    def rotate(self, pe: PositionEncoding, q: Tensor, k: Tensor, step: Step) -> tuple[Tensor, Tensor]:
        """The scheme's rotation of queries and keys (B, H, T, D) at the step's positions."""
        return pe.rotate(q, k, step.positions)

    def reconfigure(self, old: GPTConfig, config: GPTConfig) -> None:
        """Take the mask and scaling of `config` (`GPT.switch`), keeping the weights."""

    def reconfigure_replaces_parameters(self, old: GPTConfig, config: GPTConfig) -> bool:
        """Whether `reconfigure(old, config)` would put new parameters in place of old ones."""
        return False

    @classmethod
    def needs(
        cls,
        pe: PositionEncoding | type[PositionEncoding],
        mask: AttentionMask,
        score: type[Score],
        device: torch.device | None = None,
        dropout_active: bool = False,
        needs_grad: bool = False,
        decoding: bool = False,
        head_size: int | None = None,
    ) -> Needs:
        """What a forward pass with scheme `pe`, `mask` and `score` asks of this function's kernels
        (with no device: what holds on every device, as a config's validation asks)."""
        return Needs(
            score_bias=pe.score_bias,
            bias_gradients=pe.learned_bias and needs_grad,
            dropout=dropout_active and cls.drops_weights,
            backward_on=device.type if needs_grad and device is not None else None,
            runs_on=device.type if device is not None else None,
            sparse_mask=not mask.causal_only,
            decoding=decoding,
            dot_score=score.dot_product or not cls.scored,
            head_size=head_size,
        )

    @classmethod
    def choose_kernel(cls, requested: str, needs: Needs, device: torch.device) -> Kernel:
        return choose_kernel(cls.kernels, requested, needs, device)

    @classmethod
    def kernel_name(cls, kernel: Kernel) -> str:
        """The `attn_backend` name of one of this function's kernels."""
        return next(name for name, k in cls.kernels.items() if k is kernel)

    @classmethod
    def weights_kernel(cls, needs: Needs) -> Kernel:
        return weights_kernel(cls.kernels, needs)

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int) -> Cache:
        """What decoding keeps for a model of `config` (see `GPT.new_cache`)."""
        raise NotImplementedError

    @classmethod
    def constant_memory(cls, mask: AttentionMask) -> bool:
        """Whether what decoding keeps stays the same size however long it runs."""
        raise NotImplementedError


class SoftmaxAttention(Attention):
    """Multi-head causal softmax attention (Vaswani et al. 2017) over the scheme's rotated queries and
    keys; decoding keeps a KV cache shaped by the mask (a rolling one with a window)."""

    kernels = KERNELS

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.log_scale = LogLengthScale.of(config)
        self.mask = AttentionMask.of(config)

    def reconfigure(self, old: GPTConfig, config: GPTConfig) -> None:
        self.mask = AttentionMask.of(config)
        if _log_scaling_changes(old, config):
            scale = LogLengthScale.of(config)
            weight = self.qkv.weight
            self.log_scale = scale.to(device=weight.device, dtype=weight.dtype) if scale is not None else None

    def reconfigure_replaces_parameters(self, old: GPTConfig, config: GPTConfig) -> bool:
        return _log_scaling_changes(old, config) and "learned" in (old.attn_log_scaling, config.attn_log_scaling)

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerCache | None = None) -> Tensor:
        q, k, v = self.attended(x, pe, plan, cache)
        y = plan.attend(q, k, v, self.score, self.dropout if self.training else 0.0)  # (B, H, T, D)
        return self.output(y)

    def attended(
        self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The queries of the new tokens and the keys and values they attend over, as the kernels take
        them: scored (q W for the general score), rotated at their absolute positions, the keys and
        values the cache holds added, the queries log-length scaled."""
        q, k, v = self.project(x)
        q = self.score.queries(q)  # what the kernels score, rotated like q
        q, k = self.rotate(pe, q, k, plan.step)
        if cache is not None:
            k, v = cache.update(k, v, plan.cache_step)  # the keys and values the plan describes
        if self.log_scale is not None:
            q = self.log_scale(q, self.mask.seen_keys(query_indices(plan.step)))
        return q, k, v

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int) -> Cache:
        return KVCache(config.n_layer, capacity, mask)

    @classmethod
    def constant_memory(cls, mask: AttentionMask) -> bool:
        return mask.rolling  # a window's rolling cache


class SigmoidAttention(SoftmaxAttention):
    """Sigmoid attention (Ramapuram et al. 2025; `model.sigmoid_attention`): softmax attention's layer
    and KV cache, with weights sigmoid(score - ln n) that are not normalised over the keys; n the
    training length, or the keys each query sees (`config.sigmoid_bias`)."""

    kernels = SIGMOID_KERNELS

    @classmethod
    def kernel_context(
        cls, kernel: Kernel, config: GPTConfig, bias: ScoreBias | None, mask: AttentionMask, step: Step, memo: dict
    ) -> Any:
        return kernel.context(bias, mask, step, memo, length=sigmoid_length(config))


class DifferentialAttention(SoftmaxAttention):
    """Differential attention (Ye et al., ICLR 2025): the difference of two softmax maps,

        DiffAttn = (softmax(q1 k1^T / sqrt(d)) - lambda softmax(q2 k2^T / sqrt(d))) v,

    each head's queries and keys split in two halves of d = D / 2 (so the head count and the
    parameters are softmax attention's), lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
    learned per layer (four vectors of d, from N(0, 0.1^2)), lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))
    for layer l = 1..L, and each head's output RMS-normalised (a learned gain over D, shared by the
    heads) and scaled by 1 - lambda_init, as the paper's code does. The difference cancels the
    attention both maps give to irrelevant context (the "noise").

    Both maps run on softmax attention's kernels, one call each. How a head splits is
    `config.diff_split`. `half_heads` (the default) is the official code's (microsoft/unilm,
    Diff-Transformer/multihead_diffattn.py: q and k viewed as 2H half-heads of d, the rotary
    embedding built for head_dim d applied to each): the first d dimensions of the head are map 1's,
    the last d map 2's, each rotated by RoPE of width d, so both maps have the same frequencies.
    `rope_pairs` (checkpoints written before the option) rotates the whole head with RoPE of width D
    and gives map 1 the even pairs and map 2 the odd ones (pair i = dimensions i and i + D/2): map 2's
    frequencies fall between map 1's. Either way q1 . k1 and q2 . k2 depend on relative position only.
    Attention maps show w1 - lambda w2. Decoding keeps softmax attention's KV cache."""

    value_passes = 2

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        half = self.head_dim // 2
        self.score = self.score.scoring(half)  # each map scores d = D / 2 dimensions: 1 / sqrt(d)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer)  # the paper's l - 1 = this 0-based index
        # lq1, lk1, lq2, lk2: vectors (no weight decay, as every 1-D parameter)
        self.lambdas = nn.ParameterList(nn.Parameter(torch.empty(half).normal_(mean=0.0, std=0.1)) for _ in range(4))
        self.head_norm = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.split = config.diff_split
        if self.split == "half_heads":
            index = torch.arange(self.head_dim).view(2, half)  # map 1: the first half, map 2: the second
        else:  # rope_pairs: (half of the head, pair, parity) -> the even pairs, then the odd ones
            index = torch.arange(self.head_dim).view(2, half // 2, 2).permute(2, 0, 1).reshape(2, half)
        self.register_buffer("halves", index, persistent=False)

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        if config.head_dim % 4:
            raise ConfigError(
                f"attention='differential' splits each head in two halves of whole RoPE pairs, so the head size "
                f"n_embd / n_head = {config.head_dim} must be a multiple of 4: change n_embd or n_head."
            )
        if not SCORES[config.attn_score].dot_product:
            raise ConfigError(
                f"attention='differential' scores half of each head per map, a dot product; attn_score="
                f"{config.attn_score!r} is not one: use attn_score scaled_dot, dot or general."
            )
        if config.rope_fraction != 1.0 and config.rope_partial == "neox" and config.diff_split == "rope_pairs":
            raise ConfigError(
                "attention='differential' with diff_split='rope_pairs' splits heads by RoPE pairs of the whole head, "
                "which rope_partial='neox' does not make: use diff_split='half_heads', rope_partial='p_rope', or "
                "rope_fraction 1."
            )

    @classmethod
    def kernel_head_size(cls, head_dim: int) -> int:
        return head_dim // 2

    @classmethod
    def rotary_dim(cls, config: GPTConfig) -> int:
        return config.head_dim // 2 if config.diff_split == "half_heads" else config.head_dim

    def rotate(self, pe: PositionEncoding, q: Tensor, k: Tensor, step: Step) -> tuple[Tensor, Tensor]:
        if self.split != "half_heads":
            return super().rotate(pe, q, k, step)
        B, H, T, D = q.shape
        halves = [t.unflatten(-1, (2, D // 2)).transpose(2, 3).flatten(1, 2) for t in (q, k)]  # (B, 2H, T, d)
        q2, k2 = pe.rotate(*halves, step.positions)
        return tuple(t.unflatten(1, (H, 2)).transpose(2, 3).flatten(-2) for t in (q2, k2))  # (B, H, T, D)

    def weight(self) -> Tensor:
        """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, a float32 scalar."""
        lq1, lk1, lq2, lk2 = (p.float() for p in self.lambdas)
        return torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + self.lambda_init

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerCache | None = None) -> Tensor:
        q, k, v = self.attended(x, pe, plan, cache)
        lam = self.weight()
        dropout = self.dropout if self.training else 0.0
        maps = _difference_hooks(plan.on_weights, lam)
        (q1, q2), (k1, k2) = (t[..., self.halves].unbind(-2) for t in (q, k))  # (B, H, T, d) each
        y1 = dataclasses.replace(plan, on_weights=maps[0]).attend(q1, k1, v, self.score, dropout)
        y2 = dataclasses.replace(plan, on_weights=maps[1]).attend(q2, k2, v, self.score, dropout)
        # the difference in float32 (it cancels where lambda is near 1), normalised in the gain's dtype
        y = (y1.float() - lam * y2.float()).to(self.head_norm.weight.dtype)
        y = self.head_norm(y).to(y1.dtype) * (1.0 - self.lambda_init)
        return self.output(y)


def _difference_hooks(on_weights: WeightsHook | None, lam: Tensor) -> tuple[WeightsHook | None, WeightsHook | None]:
    """Hooks for the two maps' weights that hand `on_weights` w1 - lambda w2, row block by row block."""
    if on_weights is None:
        return None, None
    first: dict[tuple[int, int], Tensor] = {}

    def keep(rows: slice, weights: Tensor) -> None:
        first[(rows.start, rows.stop)] = weights

    def combine(rows: slice, weights: Tensor) -> None:
        on_weights(rows, first.pop((rows.start, rows.stop)) - lam.to(weights.dtype) * weights)

    return keep, combine


def _log_scaling_changes(old: GPTConfig, new: GPTConfig) -> bool:
    return (old.attn_log_scaling, old.attn_log_scale) != (new.attn_log_scaling, new.attn_log_scale)


def query_indices(step: Step) -> Tensor:
    """Where the step's queries stand among the keys: (B, Tq) when decoding (each row's cache
    position), else 0..Tq-1 (randomized positions are labels, not counts)."""
    if step.k_pos is not None:
        return step.positions
    return torch.arange(step.q_len, device=step.device)


class LinearAttention(Attention):
    """Causal linear attention (Katharopoulos et al. 2020; `model.linear_attention`): features
    phi(q), phi(k), the scheme's rotation on them for the numerator only (RoFormer); decoding keeps
    the running sums, the same size after any number of tokens. No attention weights to drop and no
    scoring function; its kernels take no score bias and no window."""

    kernels = LINEAR_KERNELS
    drops_weights = False
    scored = False

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerStateCache | None = None) -> Tensor:
        q, k, v = self.project(x)
        fq, fk = feature_map(q), feature_map(k)
        rq, rk = pe.rotate(fq, fk, plan.step.positions)
        q2, k2 = torch.cat([rq, fq], dim=-1), torch.cat([rk, fk], dim=-1)
        y = cache.attend(q2, k2, v, plan.cache_step) if cache is not None else plan.attend(q2, k2, v, self.score, 0.0)
        return self.output(y)

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int) -> Cache:
        return StateCache(config.n_layer)

    @classmethod
    def constant_memory(cls, mask: AttentionMask) -> bool:
        return True


ATTENTIONS: dict[str, type[Attention]] = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "sigmoid": SigmoidAttention,
    "differential": DifferentialAttention,
}
"""The attention functions by `attention` name: each a layer class with its own kernels."""
