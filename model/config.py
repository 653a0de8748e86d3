"""The model's configuration: one frozen dataclass, saved inside every checkpoint, so a checkpoint
alone rebuilds its model.

The names of the position scheme, the attention function, its kernel and the scoring function are
keys of their registries (`model.positions.SCHEMES`, `model.attention.ATTENTIONS` and each
function's kernels, `model.scores.SCORES`): a new one is a class and a registry line, and no code
here changes (the fields' documentation lists the built-in ones). Validation checks them against
the registries and checks that the attention function has a kernel for the combination
(`model.validation.check_config`), so that a config that cannot run is refused when it is built,
before any data is prepared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from core.errors import ConfigError
from model.masks import RANDOM_DRAWS

RopeScaling = Literal["none", "linear", "ntk", "yarn"]
ROPE_SCALINGS: tuple[str, ...] = get_args(RopeScaling)
RopePartial = Literal["p_rope", "neox"]
ROPE_PARTIALS: tuple[str, ...] = get_args(RopePartial)


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
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (0 disables it)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as GPT-2 has; False is slightly faster and as good."""
    pos_encoding: str = "learned"
    """Position scheme, a key of model.positions.SCHEMES: learned | sinusoidal | rope | alibi | t5 (relative bias) |
    kerple (learned log-distance bias) |
    fire (an MLP of log-normalized distances, Li et al. 2024) | none (NoPE: causal mask only)."""
    attn_backend: str = "auto"
    """Attention kernel, auto (fastest correct choice per device) or a key of the attention function's kernels:
    eager (reference) | sdpa | flex (CUDA); for attention='linear': chunked | eager (the quadratic reference); for
    attention='sigmoid': eager | flex (CUDA)."""
    attention: str = "softmax"
    """Attention function, a key of model.attention.ATTENTIONS: softmax (Vaswani et al.) or linear: causal
    kernelized attention with phi = elu + 1 (Katharopoulos et al. 2020), O(T) memory and a constant-size
    decoding state; no score-bias schemes, no windows; sigmoid: sigmoid(score - ln n) per key, n the
    training length (sigmoid_bias), not normalised (Ramapuram et al. 2025; kernels eager and flex); or differential:
    the difference of two softmax maps over the halves of each head (Ye et al. 2025; softmax's kernels)."""
    diff_split: Literal["half_heads", "rope_pairs"] = "half_heads"
    """attention='differential': how each head's queries and keys split into the two maps. half_heads: two
    half-heads of D / 2 dimensions, each rotated by RoPE built for D / 2, so both maps share one set of
    frequencies (the official code, microsoft/unilm Diff-Transformer/multihead_diffattn.py); rope_pairs: the
    whole head rotated, its even and odd RoPE pairs the two maps, whose frequencies interleave (checkpoints
    before this option)."""
    sigmoid_bias: Literal["train_length", "seen_keys"] = "train_length"
    """attention='sigmoid': the n of its bias b = -ln n. train_length: block_size, one constant for every query,
    unchanged when evaluating longer (the paper's, Ramapuram et al. 2025, and apple/axlearn's); seen_keys: the
    keys each query sees, per query (checkpoints before this option)."""
    rope_base: float = 10000.0
    """RoPE frequency base (theta): pair i rotates by position * rope_base^(-2i/head_dim)."""
    rope_scaling: RopeScaling = "none"
    """RoPE context extension, usually set at evaluation time: linear (position interpolation), ntk, yarn."""
    rope_scaling_factor: float = 1.0
    """How many times block_size the scaled RoPE should cover (1 changes nothing)."""
    rope_fraction: float = 1.0
    """Share of each head's dimensions RoPE rotates (1.0: all); the rest carry no position. How they are
    chosen is `rope_partial`."""
    rope_partial: RopePartial = "p_rope"
    """With rope_fraction < 1: p_rope keeps the highest-frequency pairs and leaves the lowest-frequency ones
    unrotated (Barbero et al. 2025, "Round and round we go"); neox rotates the first rope_fraction x head_dim
    dimensions with frequencies spread over them, the rest pass through (GPT-NeoX's rotary_pct)."""
    t5_num_buckets: int = 32
    """pos_encoding='t5': learned biases per head for this many buckets of distance, half of them exact."""
    t5_max_distance: int = 128
    """pos_encoding='t5': distances from here on share the last bucket."""
    fire_width: int = 32
    """pos_encoding='fire': hidden ReLU units of the MLP that maps a normalized distance to each head's bias."""
    fire_per_layer: bool = False
    """pos_encoding='fire': one c, L and MLP per layer (the paper's FIRE) instead of one shared by every layer
    (its FIRE-S, as T5's bias is shared)."""
    attn_score: str = "scaled_dot"
    """Scoring function, a key of model.scores.SCORES: scaled_dot (q.k / sqrt(D), Vaswani) | dot (q.k, Luong) |
    general (q.W k, Luong; W learned per head, from I / sqrt(D)) | additive (v.tanh(Wq q + Wk k), Bahdanau; eager
    kernel only, chunked over queries)."""
    attn_window: int = 0
    """Sliding-window attention: each token sees itself and the W - 1 tokens before it (0: all earlier
    tokens). Decoding then keeps only the last W keys (plus sinks)."""
    attn_sinks: int = 0
    """With a window: the first S tokens stay visible to every token (StreamingLLM's attention sinks)."""
    attn_random_blocks: int = 0
    """With a window: each block of attn_sparse_block queries also sees this many random earlier blocks of keys,
    drawn by attn_random_seed. Window + sinks + random blocks is BigBird's sparse attention (Zaheer et al. 2020),
    causal; decoding then keeps every key (random blocks reach any of them)."""
    attn_random_draw: Literal["bigbird", "earlier_with_replacement"] = "bigbird"
    """attn_random_blocks: bigbird draws R distinct blocks among those with no sink token that end before the
    window of the query block's first query (BigBird's rule, all of them when fewer); earlier_with_replacement
    draws R times among all earlier blocks, window and sink blocks included (checkpoints before this option)."""
    attn_sparse_block: int = 64
    """attn_random_blocks: keys per random block; must divide block_size."""
    attn_random_seed: int = 0
    """attn_random_blocks: seed of the draws (fixed: the same blocks at every length, in training and evaluation)."""
    attn_log_scaling: Literal["none", "fixed", "learned"] = "none"
    """Log-length attention scaling (SSMax, Nakanishi 2025; the log-length temperature of YaRN and DroPE):
    each query times s * ln(n), n the number of keys it sees, so scores sharpen as the context grows instead
    of flattening. fixed: s = attn_log_scale; learned: s per head and layer, starting there. Softmax only."""
    attn_log_scale: float | None = None
    """s of attn_log_scaling (default 1 / ln(block_size): at the training length the scale is 1)."""
    chunked_loss: bool = False
    """Compute the loss through the output layer a chunk of rows at a time, never forming the (B, T, V)
    logits (model/loss.py): the same loss and gradients, less memory; forward then returns no logits."""
    gelu_approximate: str = "none"
    """The MLP's GELU: none (exact, erf; nanoGPT's) or tanh (the approximation GPT-2 was trained with)."""
    init_from: str | None = None
    """Start training from pretrained weights: gpt2 | gpt2-medium | gpt2-large | gpt2-xl (OpenAI's, from the
    Hugging Face cache) or a directory holding a GPT-2-layout model.safetensors. The shape must be the
    weights' (configs/finetune_gpt2.yaml has GPT-2 small's); another pos_encoding than learned replaces
    GPT-2's position table (a scheme switch at step 0). Read only when a run starts afresh."""

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output layer: a small vocabulary as is, a large one rounded
        up to a multiple of 64 (GPT-2's 50257 -> 50304, nanoGPT's trick for faster matmuls). The extra
        rows are never targets, and the sampler never draws them."""
        n = self.vocab_size
        return n if n <= 256 else -(-n // 64) * 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "fire_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of {self.n_embd} or change n_embd."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling_factor < 1.0:
            raise ConfigError(f"GPTConfig.rope_scaling_factor must be >= 1, got {self.rope_scaling_factor!r}.")
        _check_choice("rope_partial", self.rope_partial, ROPE_PARTIALS)
        _check_choice("attn_log_scaling", self.attn_log_scaling, ("none", "fixed", "learned"))
        _check_choice("gelu_approximate", self.gelu_approximate, ("none", "tanh"))
        _check_choice("attn_random_draw", self.attn_random_draw, RANDOM_DRAWS)
        _check_choice("diff_split", self.diff_split, ("half_heads", "rope_pairs"))
        _check_choice("sigmoid_bias", self.sigmoid_bias, ("train_length", "seen_keys"))
        if self.attn_log_scale is not None and not self.attn_log_scale > 0:
            raise ConfigError(f"GPTConfig.attn_log_scale must be positive (or None), got {self.attn_log_scale!r}.")
        if self.attn_log_scaling != "none" and self.attn_log_scale is None and self.block_size < 2:
            raise ConfigError("GPTConfig.attn_log_scaling needs block_size >= 2 or an explicit attn_log_scale.")
        if isinstance(self.rope_fraction, bool) or not 0.0 < self.rope_fraction <= 1.0:
            raise ConfigError(
                f"GPTConfig.rope_fraction must be in (0, 1] (1: every dimension), got {self.rope_fraction!r}."
            )
        if self.rope_base <= 0:
            raise ConfigError(f"GPTConfig.rope_base must be positive, got {self.rope_base!r}.")
        for name in ("attn_window", "attn_sinks", "attn_random_blocks", "attn_random_seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"GPTConfig.{name} must be an integer >= 0, got {value!r}.")
        if self.attn_sinks and not self.attn_window:
            raise ConfigError(
                "GPTConfig.attn_sinks keeps the first tokens visible beyond a window: set attn_window > 0."
            )
        self._check_random_blocks()
        from model.validation import check_config  # the registries, and their kernels: at the first config

        check_config(self)  # the registries' half: names, each scheme's needs, a kernel for the combination

    def _check_random_blocks(self) -> None:
        block = self.attn_sparse_block
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ConfigError(f"GPTConfig.attn_sparse_block must be a positive integer, got {block!r}.")
        if not self.attn_random_blocks:
            return
        if not self.attn_window:
            raise ConfigError(
                "GPTConfig.attn_random_blocks adds random blocks to a window's keys (BigBird): set attn_window > 0."
            )
        if self.block_size % block:
            raise ConfigError(
                f"GPTConfig.attn_sparse_block must be a positive divisor of block_size {self.block_size}, got "
                f"{block!r}: pick one of {[d for d in (16, 32, 64, 128, 256) if self.block_size % d == 0] or [1]}."
            )

    @property
    def head_dim(self) -> int:
        """Size of each attention head (n_embd / n_head)."""
        return self.n_embd // self.n_head

    @property
    def rotary_dim(self) -> int:
        """Width of the vectors RoPE rotates as one, as the attention function declares it
        (`Attention.rotary_dim`): the head, or differential attention's half-heads."""
        from model.attention import ATTENTIONS

        return ATTENTIONS[self.attention].rotary_dim(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field, for checkpoints and logs."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Rebuild a config from `to_dict` output (a checkpoint's, a run's config.yaml); unknown keys are
        an error that names them. A field a model depends on that the dict lacks was written before the
        field existed: it takes the behaviour of that time (`BEFORE_FIELD`), so an old checkpoint goes on
        computing what it was trained with."""
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in values.items() if k not in REMOVED_FIELDS}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"Unknown GPTConfig field(s) {unknown}; valid fields: {sorted(known)}.")
        before = {f: old for f, (old, applies) in BEFORE_FIELD.items() if f not in values and applies(values)}
        return cls(**values, **before)


REMOVED_FIELDS = frozenset({"linear_backend"})
"""Fields that older configs record and that no longer exist: read and dropped (linear_backend chose who
multiplied float32 matrices on a CPU, which changed no result beyond rounding; removed in issue 35)."""

BEFORE_FIELD: dict[str, tuple[Any, Any]] = {
    "attn_random_draw": ("earlier_with_replacement", lambda v: v.get("attn_random_blocks", 0) > 0),
    "diff_split": ("rope_pairs", lambda v: v.get("attention") == "differential"),
    "sigmoid_bias": ("seen_keys", lambda v: v.get("attention") == "sigmoid"),
}
"""Fields that changed what a model computes when they were added (issue 33: the papers' defaults): the value
that keeps the earlier behaviour, and for which recorded configs it matters (elsewhere the default is kept, so
that an unrelated old run resumes with today's config)."""


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"GPTConfig.{field} must be one of {list(choices)}, got {value!r}.")
