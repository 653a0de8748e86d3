"""The registry half of `GPTConfig`'s validation (`check_config`): names, each scheme's and function's
needs, and a kernel for the combination, refused in one line naming the settings and what would work."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from posgpt.core.errors import ConfigError, did_you_mean
from posgpt.model.attention import ATTENTIONS, QK_NORMS
from posgpt.model.kernels import AUTO, Lack
from posgpt.model.layout import LayerKind, check_layout, layer_kinds, scheme_differs
from posgpt.model.masks import AttentionMask
from posgpt.model.positions import SCHEMES
from posgpt.model.roles import Role
from posgpt.model.scores import SCORES

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


def kernel_names() -> list[str]:
    """Every kernel name of every attention function, in registry order (the `attn_backend`s besides auto)."""
    return list(dict.fromkeys(name for layer in ATTENTIONS.values() for name in layer.kernels))


def check_config(config: GPTConfig) -> None:
    """Raise `ConfigError` for a config no model can be built from: an unknown name, a scheme that
    refuses the shape, or settings no kernel of the attention function can run together."""
    for field, names in registries(kernel_names()).items():
        value = getattr(config, field)
        if value not in names:
            hint = did_you_mean(str(value), names, "") or "."
            raise ConfigError(f"GPTConfig.{field} must be one of {names}, got {value!r}{hint}")
    check_layout(config)
    scheme = SCHEMES[config.pos_encoding]
    if config.rope_fraction != 1.0 and not scheme.partial_rotation:
        raise ConfigError(
            f"GPTConfig.rope_fraction {config.rope_fraction} rotates part of each head, which "
            f"pos_encoding={config.pos_encoding!r} does not do: use pos_encoding='rope', or rope_fraction 1."
        )
    scheme.check(config)
    kinds = layer_kinds(config)  # each kind's config, validated as a model's: a kind's refusal names it
    if config.layout:  # the function's checks below are each kind's (its own function, options and kernels)
        _check_kinds(config, kinds)
        return
    layer = ATTENTIONS[config.attention]
    layer.check(config)
    scales = config.fields_with(Role.SCALE)
    for field in config.fields_with(Role.QUERY):  # set where the default is not
        off = config.__dataclass_fields__[field].default
        if getattr(config, field) != off and not layer.scored:
            raise ConfigError(
                f"GPTConfig.{field} acts on the queries of a score, and attention={config.attention!r} forms none: "
                f"use a scored attention function (say softmax), or {field} {off!r}."
            )
        if getattr(config, field) != off and field in scales and not SCORES[config.attn_score].dot_product:
            raise ConfigError(
                f"GPTConfig.{field} scales the query of a dot-product score, and attn_score={config.attn_score!r} "
                f"is not one: use attn_score scaled_dot, dot or general, or {field} {off!r}."
            )
    if config.layout is None:  # (): one kind of a layout, checked with the others (`_check_kinds`)
        _check_kinds(config, kinds)
    if config.attn_backend != AUTO and config.attn_backend not in layer.kernels:
        raise ConfigError(
            f"attn_backend={config.attn_backend!r} is not a kernel of attention={config.attention!r}, whose "
            f"kernels are {', '.join([AUTO, *layer.kernels])}; {_alternatives(config, 'attention')}."
        )
    missing = _unmet(config)
    if missing:
        raise ConfigError(_refusal(config, missing))


def _check_kinds(config: GPTConfig, kinds: list[LayerKind]) -> None:
    """What holds across a model's kinds: the model's scheme with parameters used by some layer, and Llama 4's
    QK-norm on some layer that rotates."""
    scheme = SCHEMES[config.pos_encoding]
    if config.layout and scheme.learned_bias and all(scheme_differs(config, kind.config) for kind in kinds):
        raise ConfigError(  # its parameters would train nowhere (and DDP refuses parameters without gradients)
            f"GPTConfig.kinds each set their own position scheme or read none, so no layer would use the model's "
            f"pos_encoding={config.pos_encoding!r} and its parameters: set it as one kind's, or to 'none'."
        )
    rotates = any(SCHEMES[kind.config.pos_encoding].rotates for kind in kinds)
    for kind in kinds:
        norm = QK_NORMS[kind.config.qk_norm]
        if norm and norm.after_rotation and not rotates:
            before = [name for name, other in QK_NORMS.items() if other and not other.after_rotation]
            raise ConfigError(
                f"GPTConfig.qk_norm={kind.config.qk_norm!r} normalises rotated queries and keys, on rotating layers "
                f"only, and no layer here rotates (pos_encoding={config.pos_encoding!r}): use pos_encoding='rope', "
                f"or qk_norm {' or '.join(map(repr, before))}."
            )


def _unmet(config: GPTConfig) -> list[Lack]:
    """The fewest needs of `config` that a kernel it allows lacks, on any device (empty: runnable); for a
    function that scores no pairs, a score other than the standard one (it would be ignored)."""
    layer = ATTENTIONS[config.attention]
    if not layer.scored and not SCORES[config.attn_score].standard:
        return [Lack("a scoring function (it scores no query-key pairs)", "attn_score")]
    needs = layer.needs(SCHEMES[config.pos_encoding], AttentionMask.of(config), SCORES[config.attn_score],
                        dropout_active=config.dropout > 0, asked=layer.layer_terms(config))  # fmt: skip
    kernels = layer.kernels.values() if config.attn_backend == AUTO else [layer.kernels[config.attn_backend]]
    return min((needs.unmet(kernel) for kernel in kernels), key=len)


def _runs_with(config: GPTConfig, field: str, value: Any) -> bool:
    changes = {field: value}
    if field == "attn_window":
        changes.update(attn_sinks=0, attn_random_blocks=0)
    if field == "attention" and config.attn_backend not in ATTENTIONS[value].kernels:
        changes["attn_backend"] = AUTO
    candidate = copy.copy(config)  # not validated: the question is what would
    candidate.__dict__.update(changes)  # (frozen: past its __setattr__)
    try:  # what the attention function itself refuses (differential attention: the head size, the score)
        ATTENTIONS[candidate.attention].check(candidate)
    except ConfigError:
        return False
    return not _unmet(candidate)


def registries(backends: list[str]) -> dict[str, list[str]]:
    """The names each registry field takes, `attn_backend` one of `backends` or auto."""
    return {"pos_encoding": list(SCHEMES), "attention": list(ATTENTIONS), "attn_score": list(SCORES),
            "attn_backend": [AUTO, *backends], "qk_norm": list(QK_NORMS)}  # fmt: skip


def _alternatives(config: GPTConfig, field: str) -> str:
    """The other values of `field` with which `config` would run, in words."""
    names = registries(list(ATTENTIONS[config.attention].kernels))
    off = [config.__dataclass_fields__[field].default]  # a mask, dropout, soft-cap or sink logits: turned off
    able = [str(v) for v in names.get(field, off) if v != getattr(config, field) and _runs_with(config, field, v)]
    if not able:
        return f"changing {field} alone would not run it"
    listed = able[0] if len(able) == 1 else ", ".join(able[:-1]) + " or " + able[-1]
    return f"{field} {listed} would run"


def _refusal(config: GPTConfig, missing: list[Lack]) -> str:
    """One line: which setting cannot run which, why, and what would."""
    culprit = missing[0].setting or "attn_backend"
    if culprit == "attn_window" and config.attn_chunk:  # the mask beyond causal is the chunk's
        culprit = "attn_chunk"
    lacks = " and ".join(lack.words for lack in missing)
    if config.attn_backend != AUTO:
        host, why = "attn_backend", f"kernel {config.attn_backend!r} lacks {lacks}"
    else:
        host, why = "attention", f"none of its kernels ({', '.join(ATTENTIONS[config.attention].kernels)}) has {lacks}"
    host_value, culprit_value = getattr(config, host), getattr(config, culprit)
    return (
        f"{host}={host_value!r} cannot run {culprit}={culprit_value!r}: {why}. With {host}={host_value!r}, "
        f"{_alternatives(config, culprit)}; with {culprit}={culprit_value!r}, {_alternatives(config, host)}."
    )
