"""The model's configuration: one frozen dataclass, saved in every checkpoint, which alone rebuilds the model.
Scheme, attention, kernel and score names are registry keys, checked with their combination when a config is
built (`model.validation.check_config`), before any data is prepared."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from itertools import groupby
from typing import Any, Literal, get_args, get_origin, get_type_hints

from posgpt.core.errors import ConfigError
from posgpt.model.roles import Role, role

RopeScaling = Literal["none", "linear", "ntk", "yarn"]
ROPE_SCALINGS: tuple[str, ...] = get_args(RopeScaling)
AS_TRAINED: RopeScaling = "none"
"""`rope_scaling`'s value that stretches nothing: RoPE's angles as trained."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and behaviour of a GPT. Defaults are GPT-2 small (124M) with learned positions."""

    vocab_size: int = 50257
    """Number of token ids, the tokenizer's (train.py sets it from the data); GPT-2's by default."""
    block_size: int = 1024
    """Training context length. Only `learned` positions are limited to it; the other schemes run longer."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block; `n_embd` must be divisible by it."""
    n_embd: int = 768
    """Width of the residual stream."""
    dropout: float = role(0.0, Role.RESUME)
    """Dropout on embeddings, attention weights and residual branches (0 disables it)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as GPT-2 has; False is slightly faster and as good."""
    pos_encoding: str = role("learned", Role.SWITCH, Role.KIND)
    """Position scheme (model.positions.SCHEMES; docs/model.md): learned | sinusoidal | rope | alibi | t5 | kerple |
    fire | cope | none."""
    attn_backend: str = role("auto", Role.SWITCH, Role.RESUME, Role.KIND)
    """Attention kernel: auto (the fastest that runs the model), or one of its attention function's (softmax,
    differential: eager | sdpa | flex; linear: eager | chunked; sigmoid: eager | flex; stick_breaking: eager | fla;
    forgetting: eager | sdpa | flex | fla; gated_deltanet, kda: eager | chunked | fla)."""
    attention: str = role("softmax", Role.KIND)
    """Attention function (model.attention.ATTENTIONS; docs/model.md): softmax | linear | sigmoid | differential |
    stick_breaking | forgetting | gated_deltanet | kda."""
    diff_split: Literal["half_heads", "rope_pairs"] = role(
        "half_heads", Role.KIND, before=("rope_pairs", lambda v: v.get("attention") == "differential")
    )
    """attention='differential': half_heads (two half-heads, each with RoPE built for D / 2, the official code's) or
    rope_pairs (the whole head rotated, its even and odd pairs the two maps; checkpoints before this option)."""
    sigmoid_bias: Literal["train_length", "seen_keys"] = role(
        "train_length", Role.KIND, before=("seen_keys", lambda v: v.get("attention") == "sigmoid")
    )
    """attention='sigmoid': n of the bias -ln n: train_length (block_size, the paper's) or seen_keys (the keys each
    query sees; checkpoints before this option)."""
    sb_remainder: Literal["current", "drop"] = role("current", Role.KIND)
    """attention='stick_breaking': what no key takes goes to the query's own value (current, the official code's) or
    is dropped (drop)."""
    gdn_expand_k: float = role(0.75, Role.KIND)
    """attention='gated_deltanet': the keys' width over n_embd, split over n_head heads (NVlabs' 0.75)."""
    gdn_expand_v: float = role(1.5, Role.KIND)
    """attention='gated_deltanet': the values' width over n_embd (NVlabs' 1.5)."""
    kda_expand_v: float = role(1.0, Role.KIND)
    """attention='kda': each head's value size over its key size n_embd / n_head (fla's 1)."""
    delta_neg_eigval: bool = role(False, Role.KIND)
    """attention='gated_deltanet' or 'kda': beta in (0, 2), not (0, 1), so that the state's transition may have
    negative eigenvalues (fla's allow_neg_eigval, Grazzi et al. 2025; NVlabs has no such option)."""
    rope_base: float = role(10000.0, scheme="rope")
    """RoPE frequency base (theta): pair i rotates by position * rope_base^(-2i/head_dim)."""
    rope_scaling: RopeScaling = role("none", Role.RESUME, scheme="rope")
    """RoPE context extension, usually set at evaluation time: linear (position interpolation), ntk, yarn."""
    rope_scaling_factor: float = role(1.0, Role.RESUME, scheme="rope")
    """How many times the original length the scaled RoPE should cover (1 changes nothing)."""
    original_block_size: int | None = role(None, Role.RESUME, scheme="rope")
    """With a rope_scaling: the length the model was first trained at, which PI, NTK and YaRN scale from and
    `posgpt evaluate`'s dynamic factor divides by (Hugging Face's original_max_position_embeddings); None:
    block_size. A scaled fine-tune from a checkpoint at another block_size (`init_from`) keeps the checkpoint's."""
    rope_fraction: float = role(1.0, scheme="rope")
    """Share of each head's dimensions RoPE rotates (1.0: all); `rope_partial` says which."""
    rope_partial: Literal["p_rope", "neox"] = role("p_rope", scheme="rope")
    """With rope_fraction < 1: p_rope turns the fastest pairs only (Barbero et al. 2025); neox rotates the first
    dimensions with frequencies spread over them (GPT-NeoX's rotary_pct)."""
    t5_num_buckets: int = role(32, scheme="t5")
    """pos_encoding='t5': learned biases per head for this many buckets of distance, half of them exact."""
    t5_max_distance: int = role(128, scheme="t5")
    """pos_encoding='t5': distances from here on share the last bucket."""
    fire_width: int = role(32, scheme="fire")
    """pos_encoding='fire': hidden ReLU units of the MLP that maps a normalized distance to each head's bias."""
    fire_per_layer: bool = role(False, scheme="fire")
    """pos_encoding='fire': one c, L and MLP per layer (the paper's FIRE), not one shared by all (its FIRE-S)."""
    cope_positions: int | None = role(None, scheme="cope")
    """pos_encoding='cope': how many positions its tables hold, counts past the last clamped (None: block_size + 1,
    the authors' default)."""
    cope_divide: bool = role(True, scheme="cope")
    """pos_encoding='cope': the position term divided by sqrt(d) with q.k (the authors' training code); false adds
    it undivided (the paper's appendix code)."""
    attn_score: str = role("scaled_dot", Role.KIND)
    """Scoring function (model.scores.SCORES; docs/model.md): scaled_dot | dot | general | additive."""
    attn_window: int = role(0, Role.SWITCH, Role.KIND)
    """Sliding window: each token sees itself and the W - 1 tokens before it (0: all earlier tokens)."""
    attn_sinks: int = role(0, Role.SWITCH, Role.KIND)
    """With a window: the first S tokens stay visible to every token (StreamingLLM's attention sinks)."""
    attn_chunk: int = role(0, Role.SWITCH, Role.KIND)
    """Chunked local attention (Llama 4): a key is visible iff it is in the query's chunk of C positions and not
    after it (0: off; not with attn_window)."""
    attn_random_blocks: int = role(0, Role.SWITCH)
    """With a window: how many random earlier key blocks each block of queries also sees (BigBird)."""
    attn_random_draw: Literal["bigbird", "earlier_with_replacement"] = role(
        "bigbird", Role.SWITCH, before=("earlier_with_replacement", lambda v: v.get("attn_random_blocks", 0) > 0)
    )
    """attn_random_blocks: bigbird (distinct blocks clear of window and sinks) or earlier_with_replacement (any
    earlier block; checkpoints before this option)."""
    attn_sparse_block: int = role(64, Role.SWITCH)
    """attn_random_blocks: keys per random block; must divide block_size."""
    attn_random_seed: int = role(0, Role.SWITCH)
    """attn_random_blocks: seed of the draws (fixed: the same blocks at every length, in training and evaluation)."""
    attn_log_scaling: Literal["none", "fixed", "learned"] = role("none", Role.SWITCH, Role.QUERY, Role.SCALE)
    """Log-length scaling (SSMax): each query times s * ln(n), n the keys it sees; s fixed or learned per head."""
    attn_log_scale: float | None = role(None, Role.SWITCH)
    """s of attn_log_scaling (default 1 / ln(block_size): at the training length the scale is 1)."""
    attn_temperature_floor: int = role(0, Role.SWITCH, Role.KIND, Role.QUERY, Role.SCALE)
    """Llama 4's per-position query scale, q (0.1 ln(floor((p + 1) / F) + 1) + 1) at position p, F this floor (Llama
    4's 8192, on its NoPE layers; 0: off); not SSMax's attn_log_scaling."""
    layout: tuple[str, ...] | None = None
    """Each layer's kind, a pattern repeated over n_layer and cut where the layers end (Gemma 3: five local, one
    global); every name a key of `kinds` (None: every layer alike)."""
    kinds: dict[str, dict[str, Any]] | None = None
    """What each kind of `layout` sets for its layers: its attention function (attention, its own fields, attn_score,
    attn_backend), the layer's options (qk_norm, attn_gate, attn_sink_logits, attn_softcap), its mask (attn_window,
    attn_sinks, attn_chunk), attn_temperature_floor, and pos_encoding (one that acts in attention; none: NoPE) with
    its scheme's fields (rope_base, ...). A kind whose function reads no positions (gated_deltanet, kda) takes none
    of the model's scheme, mask, query options or KV heads."""
    n_kv_head: int | None = role(None, Role.LAYER)
    """Key/value heads (grouped-query attention, Ainslie et al. 2023; 1: multi-query): query head h reads KV head
    h // (n_head / n_kv_head), and the KV cache holds n_kv_head heads; must divide n_head (None: n_head)."""
    qk_norm: str = role("none", Role.LAYER, Role.QUERY, Role.KIND)
    """RMS-normalise each head's queries and keys (model.attention.QK_NORMS; docs/model.md): none | gemma3 | llama4."""
    attn_gate: Literal["none", "elementwise", "headwise"] = role("none", Role.LAYER, Role.KIND)
    """Output gate (Qiu et al. 2025): the attention output times sigmoid(W x), x the normed layer input, per
    element or one gate per head, before the output projection."""
    attn_sink_logits: bool = role(False, Role.LAYER, Role.KIND)
    """A learned logit per head in the softmax's normaliser, with no key or value (gpt-oss): the weights sum to less
    than 1. Not attn_sinks, which keeps the first tokens visible."""
    attn_softcap: float = role(0.0, Role.LAYER, Role.KIND)
    """Soft-cap c of the scaled scores, c tanh(s / c), before any position bias and the mask (Gemma 2; 0: none)."""
    chunked_loss: bool = role(False, Role.SWITCH, Role.RESUME)
    """Loss through the output layer in chunks of rows, never forming the (B, T, V) logits (forward returns none)."""
    gelu_approximate: Literal["none", "tanh"] = "none"
    """The MLP's GELU: none (exact, erf; nanoGPT's) or tanh (the approximation GPT-2 was trained with)."""
    init_from: str | None = role(None, Role.RESUME)
    """Start from GPT-2 weights: gpt2 | gpt2-medium | gpt2-large | gpt2-xl (Hugging Face cache) or a directory with
    model.safetensors, another pos_encoding replacing the position table; or from a posgpt checkpoint (a .ckpt
    file) at any block_size, scheme or scaling (a fine-tune: docs/training.md). Read only when a run starts afresh."""

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and head: a large vocabulary rounded up to a multiple of 64 (nanoGPT's trick)."""
        n = self.vocab_size
        return n if n <= 256 else -(-n // 64) * 64

    def __post_init__(self) -> None:
        if isinstance(self.layout, list):  # YAML's and a checkpoint's list: the tuple the command line gives
            object.__setattr__(self, "layout", tuple(self.layout))
        for name, (holds, what) in BOUNDS.items():
            if not holds(value := getattr(self, name)):
                raise ConfigError(f"GPTConfig.{name} must be {what}, got {value!r}.")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of {self.n_embd} or change n_embd."
            )
        if self.attn_log_scaling != "none" and self.attn_log_scale is None and self.block_size < 2:
            raise ConfigError("GPTConfig.attn_log_scaling needs block_size >= 2 or an explicit attn_log_scale.")
        if self.n_kv_head is not None and (
            isinstance(self.n_kv_head, bool) or not isinstance(self.n_kv_head, int) or self.n_kv_head < 1
            or self.n_head % self.n_kv_head
        ):  # fmt: skip
            divisors = [d for d in range(1, self.n_head + 1) if self.n_head % d == 0]
            raise ConfigError(
                f"GPTConfig.n_kv_head must divide n_head ({self.n_head}), each KV head serving as many query heads, "
                f"got {self.n_kv_head!r}: pick one of {divisors}."
            )
        for name, what in (("attn_sinks", "keeps the first tokens visible beyond a window"),
                           ("attn_random_blocks", "adds random blocks to a window's keys (BigBird)")):  # fmt: skip
            if getattr(self, name) and not self.attn_window:
                raise ConfigError(f"GPTConfig.{name} {what}: set attn_window > 0.")
        if self.attn_chunk and self.attn_window:
            raise ConfigError("GPTConfig.attn_chunk and attn_window are two local masks: set one of them to 0.")
        if self.attn_random_blocks and self.block_size % self.attn_sparse_block:
            divisors = [d for d in (16, 32, 64, 128, 256) if self.block_size % d == 0] or [1]
            raise ConfigError(
                f"GPTConfig.attn_sparse_block must be a positive divisor of block_size {self.block_size}, got "
                f"{self.attn_sparse_block!r}: pick one of {divisors}."
            )
        from posgpt.model.validation import check_config  # the registries, and their kernels: at the first config

        check_config(self)  # the registries' half: names, each scheme's needs, a kernel for the combination

    @property
    def original_length(self) -> int:
        """What RoPE's scalings stretch from: `original_block_size`, else block_size."""
        return self.original_block_size or self.block_size

    @property
    def scales_rope(self) -> bool:
        """Whether a layer's RoPE is scaled: the model's `rope_scaling`, or a kind's own (model/layout.py)."""
        kinds = (self.kinds or {}).values() if self.layout else [{}]
        return any(kind.get("rope_scaling", self.rope_scaling) != "none" for kind in kinds)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def rotary_dim(self) -> int:
        """Width of the vectors RoPE rotates as one (`Attention.rotary_dim`)."""
        from posgpt.model.attention import ATTENTIONS

        return ATTENTIONS[self.attention].rotary_dim(self)

    @classmethod
    def fields_with(cls, role: Role) -> tuple[str, ...]:
        """The fields declared with `role` (`model.roles`), in their order."""
        return tuple(f.name for f in fields(cls) if role in f.metadata.get("roles", ()))

    @classmethod
    def scheme_fields(cls, scheme: str) -> tuple[str, ...]:
        """The fields position scheme `scheme` reads beyond the model's shape."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("scheme") == scheme)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field, for checkpoints and logs."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Rebuild a config from `to_dict` output; a model field the dict lacks takes its old value (`role`'s
        `before`)."""
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in values.items() if k not in REMOVED_FIELDS}
        if values.get("layout") in ([], ()) and not values.get("kinds"):  # recorded before `layout: []` was refused
            values["layout"] = values["kinds"] = None
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"Unknown GPTConfig field(s) {unknown}; valid fields: {sorted(known)}.")
        old = {f.name: f.metadata["before"] for f in fields(cls) if f.metadata.get("before") and f.name not in values}
        before = {name: value for name, (value, applies) in old.items() if applies(values)}
        return cls(**values, **before)


REMOVED_FIELDS = frozenset({"linear_backend"})
"""Fields older configs record that no longer exist (and changed no result): read and dropped."""


def _integer(least: int) -> Callable[[Any], bool]:
    return lambda value: not isinstance(value, bool) and isinstance(value, int) and value >= least


def _number(holds: Callable[[float], bool]) -> Callable[[Any], bool]:
    return lambda value: not isinstance(value, bool) and isinstance(value, int | float) and holds(value)


BOUNDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(
        ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "fire_width", "attn_sparse_block"),
        (_integer(1), "a positive integer"),
    ),
    **dict.fromkeys(
        ("attn_window", "attn_sinks", "attn_random_blocks", "attn_random_seed", "attn_chunk", "attn_temperature_floor"),
        (_integer(0), "an integer >= 0"),
    ),
    **{  # the fields typed `Literal[...]`
        name: (get_args(hint).__contains__, f"one of {list(get_args(hint))}")
        for name, hint in get_type_hints(GPTConfig).items()
        if get_origin(hint) is Literal
    },
    "dropout": (_number(lambda v: 0 <= v < 1), "in [0, 1)"),
    "rope_base": (_number(lambda v: v > 0), "positive"),
    "rope_scaling_factor": (_number(lambda v: v >= 1), ">= 1"),
    "rope_fraction": (_number(lambda v: 0 < v <= 1), "in (0, 1] (1: every dimension)"),
    "cope_positions": (lambda v: v is None or _integer(2)(v), "at least 2 (or None)"),
    "original_block_size": (lambda v: v is None or _integer(1)(v), "a positive integer (or None: block_size)"),
    "attn_log_scale": (lambda v: v is None or _number(lambda s: s > 0)(v), "positive (or None)"),
    "attn_softcap": (_number(lambda v: v >= 0), ">= 0 (0: no cap)"),
    **dict.fromkeys(("gdn_expand_k", "gdn_expand_v", "kda_expand_v"), (_number(lambda v: v > 0), "positive")),
}
"""Each checked field's test and what the field must be, checked in this order for a config built in code, from a
file or from a checkpoint (relations between fields are `__post_init__`'s)."""


def model_tags(values: dict[str, Any]) -> list[str]:
    """What sets a model apart beside its scheme, in words for its run name, settings line and reports (its `to_dict`
    `values`): the layout as runs of a kind (`3local-global`) and each layer option set (`n_kv_head=2`)."""
    runs = [f"{n}{name}" if (n := len(list(same))) > 1 else name for name, same in groupby(values.get("layout") or ())]
    layer = GPTConfig.fields_with(Role.LAYER)
    default = {f: GPTConfig.__dataclass_fields__[f].default for f in layer}
    options = [f if v is True else f"{f}={v}" for f in layer if (v := values.get(f, default[f])) != default[f]]
    return ["-".join(runs)] * bool(runs) + options
