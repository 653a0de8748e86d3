"""The attention layers, one class per attention function, and their registry `ATTENTIONS`.

A layer projects its input to queries, keys and values, applies the position scheme, and hands
them to the forward pass's `Plan` (a kernel and the context it built once for every layer); it
never asks which kernel it has. The layer class also declares what the function is: its kernels
(each function has its own registry of them), whether attention dropout and a scoring function
apply to it, what decoding keeps (`new_cache`) and whether that stays the same size however long
decoding runs (`constant_memory`). Adding an attention function is one layer class (usually with a
kernel class of its own) and one line in `ATTENTIONS`: see docs/extending.md.

`check_config` is the registry half of `GPTConfig`'s validation: every name is in its registry,
the scheme accepts the model's shape, and the attention function has a kernel for the scheme, the
mask, the score and the dropout, so that a refused combination is refused when the config is
built, in one line naming the settings and what would work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from core.errors import ConfigError, did_you_mean
from model.cache import KVCache, LayerCache
from model.kernels import AUTO, KERNELS, Kernel, Lack, Needs, Plan, Step, choose_kernel, weights_kernel
from model.linear import Linear
from model.linear_attention import LINEAR_KERNELS, LayerStateCache, StateCache, feature_map
from model.masks import AttentionMask
from model.positions import SCHEMES, PositionEncoding
from model.scores import SCORES, LogLengthScale, Score, build_score
from model.sigmoid_attention import SIGMOID_KERNELS

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

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.qkv = Linear(config.n_embd, 3 * config.n_embd, config.bias, config.linear_backend)
        self.proj = Linear(config.n_embd, config.n_embd, config.bias, config.linear_backend)
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
    def needs(
        cls,
        pe: PositionEncoding | type[PositionEncoding],
        mask: AttentionMask,
        score: type[Score],
        device: torch.device | None = None,
        dropout_active: bool = False,
        needs_grad: bool = False,
        decoding: bool = False,
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

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.log_scale = LogLengthScale.of(config)
        self.mask = AttentionMask(config.attn_window, config.attn_sinks)

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: LayerCache | None = None) -> Tensor:
        q, k, v = self.project(x)
        q = self.score.queries(q)  # what the kernels score (q W for the general score), rotated like q
        q, k = pe.rotate(q, k, plan.step.q_start, plan.step.ids)  # the new tokens, at their absolute positions
        if cache is not None:
            k, v = cache.update(k, v, plan.cache_step)  # the keys and values the plan describes
        if self.log_scale is not None:
            q = self.log_scale(q, self.mask.seen_keys(query_indices(plan.step)))
        y = plan.attend(q, k, v, self.score, self.dropout if self.training else 0.0)  # (B, H, T, D)
        return self.output(y)

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int) -> Cache:
        return KVCache(config.n_layer, capacity, mask)

    @classmethod
    def constant_memory(cls, mask: AttentionMask) -> bool:
        return not mask.causal_only  # a window's rolling cache


class SigmoidAttention(SoftmaxAttention):
    """Sigmoid attention (Ramapuram et al. 2025; `model.sigmoid_attention`): softmax attention's layer
    and KV cache, with weights sigmoid(score - ln n) that are not normalised over the keys."""

    kernels = SIGMOID_KERNELS


def query_indices(step: Step) -> Tensor:
    """Where the step's queries stand among the keys: (B, Tq) when decoding (each row's cache
    position), else (Tq,) from `q_start` (randomized positions are labels, not counts)."""
    if step.q_pos is not None:
        return step.q_pos
    return torch.arange(step.q_start, step.q_start + step.q_len, device=step.device)


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
        rq, rk = pe.rotate(fq, fk, plan.step.q_start, plan.step.ids)
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
}
"""The attention functions by `attention` name: each a layer class with its own kernels."""


def kernel_names() -> list[str]:
    """Every kernel name of every attention function, in registry order (the valid `attn_backend`s
    besides auto)."""
    return list(dict.fromkeys(name for layer in ATTENTIONS.values() for name in layer.kernels))


def check_config(config: GPTConfig) -> None:
    """Raise `ConfigError` for a config no model can be built from: an unknown name, a scheme that
    refuses the shape, or settings no kernel of the attention function can run together."""
    _check_name("pos_encoding", config.pos_encoding, list(SCHEMES))
    _check_name("attention", config.attention, list(ATTENTIONS))
    _check_name("attn_score", config.attn_score, list(SCORES))
    _check_name("attn_backend", config.attn_backend, [AUTO, *kernel_names()])
    scheme = SCHEMES[config.pos_encoding]
    if config.rope_fraction != 1.0 and not scheme.partial_rotation:
        raise ConfigError(
            f"GPTConfig.rope_fraction {config.rope_fraction} rotates part of each head, which "
            f"pos_encoding={config.pos_encoding!r} does not do: use pos_encoding='rope', or rope_fraction 1."
        )
    scheme.check(config)
    layer = ATTENTIONS[config.attention]
    if config.attn_log_scaling != "none" and not layer.scored:
        raise ConfigError(
            f"GPTConfig.attn_log_scaling scales attention scores, and attention={config.attention!r} forms none: "
            "use attention='softmax', or attn_log_scaling 'none'."
        )
    if config.attn_log_scaling != "none" and not SCORES[config.attn_score].dot_product:
        raise ConfigError(
            f"GPTConfig.attn_log_scaling scales the query of a dot-product score, and attn_score="
            f"{config.attn_score!r} is not one: use attn_score scaled_dot, dot or general, or attn_log_scaling 'none'."
        )
    if config.attn_backend != AUTO and config.attn_backend not in layer.kernels:
        raise ConfigError(
            f"attn_backend={config.attn_backend!r} is not a kernel of attention={config.attention!r}, whose "
            f"kernels are {', '.join([AUTO, *layer.kernels])}; {_alternatives(config, 'attention')}."
        )
    missing = _unmet(config.to_dict())
    if missing:
        raise ConfigError(_refusal(config, missing))


def _check_name(field: str, value: Any, names: list[str]) -> None:
    if value not in names:
        hint = did_you_mean(str(value), names, "") or "."
        raise ConfigError(f"GPTConfig.{field} must be one of {names}, got {value!r}{hint}")


def _unmet(settings: dict[str, Any]) -> list[Lack]:
    """What the kernels that `settings` allow lack of what they ask, on any device (empty: runnable):
    the fewest such needs of any of those kernels; and, for a function that scores no query-key
    pairs, a score other than the standard one (it would be ignored)."""
    layer = ATTENTIONS[settings["attention"]]
    if not layer.scored and not SCORES[settings["attn_score"]].standard:
        return [Lack("a scoring function (it scores no query-key pairs)", "attn_score")]
    mask = AttentionMask(settings["attn_window"], settings["attn_sinks"])
    needs = layer.needs(SCHEMES[settings["pos_encoding"]], mask, SCORES[settings["attn_score"]],
                        dropout_active=settings["dropout"] > 0)  # fmt: skip
    backend = settings["attn_backend"]
    kernels = layer.kernels.values() if backend == AUTO else [layer.kernels[backend]]
    return min((needs.unmet(kernel) for kernel in kernels), key=len)


def _runs_with(config: GPTConfig, field: str, value: Any) -> bool:
    """Whether `config` with `field` set to `value` would run (a window dropped with its sinks, an
    attention function with its own kernels)."""
    settings = {**config.to_dict(), field: value}
    if field == "attn_window":
        settings["attn_sinks"] = 0
    if field == "attention" and settings["attn_backend"] not in ATTENTIONS[value].kernels:
        settings["attn_backend"] = AUTO
    return not _unmet(settings)


def _alternatives(config: GPTConfig, field: str) -> str:
    """The other values of `field` with which `config` would run, in words."""
    values: dict[str, list[Any]] = {
        "pos_encoding": list(SCHEMES),
        "attention": list(ATTENTIONS),
        "attn_score": list(SCORES),
        "attn_backend": [AUTO, *ATTENTIONS[config.attention].kernels],
        "attn_window": [0],
        "dropout": [0.0],
    }
    able = [str(v) for v in values[field] if v != getattr(config, field) and _runs_with(config, field, v)]
    if not able:
        return f"changing {field} alone would not run it"
    listed = able[0] if len(able) == 1 else ", ".join(able[:-1]) + " or " + able[-1]
    return f"{field} {listed} would run"


def _refusal(config: GPTConfig, missing: list[Lack]) -> str:
    """One line: which setting cannot run which, why, and what would."""
    host = "attn_backend" if config.attn_backend != AUTO else "attention"
    culprit = missing[0].setting or "attn_backend"
    lacks = " and ".join(lack.words for lack in missing)
    if host == "attn_backend":
        why = f"kernel {config.attn_backend!r} lacks {lacks}"
    else:
        why = f"none of its kernels ({', '.join(ATTENTIONS[config.attention].kernels)}) has {lacks}"
    host_value, culprit_value = getattr(config, host), getattr(config, culprit)
    return (
        f"{host}={host_value!r} cannot run {culprit}={culprit_value!r}: {why}. With {host}={host_value!r}, "
        f"{_alternatives(config, culprit)}; with {culprit}={culprit_value!r}, {_alternatives(config, host)}."
    )
