"""Per-layer layouts (`GPTConfig.layout`, `kinds`): each layer's kind, and the config its layers are built from.

A layout names each layer's kind as a short pattern repeated over the layers and cut where they end (Gemma 3's
five local layers and one global one over 26 or 34 layers). A kind sets fields of the model's config for its
layers: the mask (`attn_window`, `attn_sinks`, `attn_chunk`), the position scheme where it acts in attention
(`pos_encoding`, and its own fields such as `rope_base`; `none` is a NoPE layer) and Llama 4's query scale
(`attn_temperature_floor`). The layers of a kind are then built and run from that config, as a model of it
would be: its scheme, its mask, its kernel, its part of the KV cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posgpt.core.errors import ConfigError, did_you_mean
from posgpt.model.attention import ATTENTIONS, Attention
from posgpt.model.masks import AttentionMask
from posgpt.model.positions import SCHEMES
from posgpt.model.roles import Role

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


@dataclass(frozen=True)
class LayerKind:
    """The layers of one kind: its name (in a layout; None without one: every layer), the config they are built
    from, their indices, their mask, their attention function's layer class."""

    name: str | None
    config: GPTConfig
    layers: tuple[int, ...]
    mask: AttentionMask
    attention: type[Attention]


def scheme_differs(old: GPTConfig, new: GPTConfig) -> bool:
    """Whether `new` has another position scheme than `old` (another one, or its fields changed): a switch builds it
    anew, a kind of a layout has its own."""
    fields = new.scheme_fields(new.pos_encoding)
    return old.pos_encoding != new.pos_encoding or any(getattr(old, f) != getattr(new, f) for f in fields)


def layer_kinds(config: GPTConfig) -> list[LayerKind]:
    """The kinds of `config`'s layers in order of first use (no layout: one kind, the model's own config)."""
    if not config.layout:
        every = tuple(range(config.n_layer))
        return [LayerKind(None, config, every, AttentionMask.of(config), ATTENTIONS[config.attention])]
    pattern = [config.layout[i % len(config.layout)] for i in range(config.n_layer)]
    kinds = []
    for name in dict.fromkeys(pattern):
        settings = (config.kinds or {})[name] or {}
        function = ATTENTIONS.get(settings.get("attention", config.attention))
        inherited = unpositioned(config) if function is not None and not function.takes_positions else {}
        try:
            built = dataclasses.replace(config, layout=(), kinds={}, **{**inherited, **settings})  # (), {}: a kind's
        except ConfigError as error:
            raise ConfigError(f"GPTConfig.kinds[{name!r}]: {error}") from None
        layers = tuple(i for i, kind in enumerate(pattern) if kind == name)
        kinds.append(LayerKind(name, built, layers, AttentionMask.of(built), ATTENTIONS[built.attention]))
    return kinds


def unpositioned(config: GPTConfig) -> dict[str, object]:
    """What a kind whose function reads no positions takes instead of the model's: no scheme that acts in attention
    (nor its fields; one on the embeddings acts before every layer), no mask or score, none of the layer options of
    the pair-scoring layers (KV heads, QK-norm, output gate, sink logits, soft-cap) nor of their queries; what it sets
    itself is checked as a model's would be."""
    fields = {f.name: f.default for f in dataclasses.fields(config)}
    pairs = ("attn_window", "attn_sinks", "attn_chunk", "attn_random_blocks", "attn_score")  # masks and the score
    off = {name: fields[name] for name in (*pairs, *config.fields_with(Role.LAYER), *config.fields_with(Role.QUERY))}
    if SCHEMES[config.pos_encoding].embeds:
        return off
    return off | {"pos_encoding": "none"} | {name: fields[name] for name in config.scheme_fields(config.pos_encoding)}


def check_layout(config: GPTConfig) -> None:
    """Refuse a layout that names a kind `kinds` lacks, a kind nothing uses, a field a kind may not set, or a
    scheme per kind that acts on the embeddings (learned, sinusoidal: once, for every layer)."""
    if config.layout == () and config.kinds != {}:  # (), {}: the config of one kind's layers (`layer_kinds`)
        raise ConfigError(
            "GPTConfig.layout [] names no kind: list each layer's kind, e.g. [local, global], or leave layout out."
        )
    if not config.layout:
        if config.layout is None and config.kinds is not None:
            raise ConfigError("GPTConfig.kinds says what each kind of a layout sets: set layout too, or drop kinds.")
        return
    kinds = config.kinds or {}
    if isinstance(config.layout, str) or not all(isinstance(name, str) and name for name in config.layout):
        raise ConfigError(
            f"GPTConfig.layout must be a list of kind names, e.g. [local, global], got {config.layout!r}."
        )
    unknown = sorted(set(config.layout) - set(kinds))
    if unknown:
        raise ConfigError(
            f"GPTConfig.layout names kind(s) {unknown} that kinds does not define: add them to kinds ({{}} for a "
            "layer of the model's own settings)."
        )
    unused = sorted(set(kinds) - set(config.layout))
    if unused:
        raise ConfigError(f"GPTConfig.kinds defines {unused}, which the layout never uses: drop them or use them.")
    allowed = set(config.fields_with(Role.KIND))
    for name, settings in kinds.items():
        settings = {} if settings is None else settings
        wrong = sorted(set(settings) - allowed) if isinstance(settings, dict) else [repr(settings)]
        if wrong:
            raise ConfigError(
                f"GPTConfig.kinds[{name!r}] sets {', '.join(wrong)}, which a kind cannot set; a kind sets "
                f"{', '.join(sorted(allowed))}{did_you_mean(wrong[0], sorted(allowed), '') or '.'}"
            )
        scheme = settings.get("pos_encoding")
        if scheme in SCHEMES and SCHEMES[scheme].embeds:
            raise ConfigError(
                f"GPTConfig.kinds[{name!r}] sets pos_encoding={scheme!r}, which acts once on the embeddings, not per "
                "layer: set it as the model's pos_encoding, or give the kind a scheme that acts in attention."
            )
