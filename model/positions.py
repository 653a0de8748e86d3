"""Position schemes behind one small interface, and the registry that builds them from a config.

Every scheme implements up to three hooks, each a no-op by default:

- `embed(x, start, ids)`        adds something to the token embeddings (learned, sinusoidal);
- `rotate(q, k, start, ids)`    rotates queries and keys per head (RoPE);
- `relative_bias(h, d)`    a bias on the attention score of head h for a query d positions after
  its key (ALiBi). It is written once: the dense (H, Tq, Tk) bias of eager and SDPA is this
  function on index grids, and FlexAttention's `score_mod` calls it inside the fused kernel.

and declares what it is (capabilities that kernels, training and evaluation read, never the
scheme's name): `longest(config)` (None: no limit; the instance's `max_positions`), `score_bias`
and `learned_bias` (a bias on the scores, and whether it has parameters whose gradients a kernel
must carry), `uses_positions` (False for NoPE: nothing to randomize), `rescalable` (its angles can
be stretched past the training length at evaluation: RoPE's PI / NTK / YaRN), and `check(config)`
(what the scheme needs of the model's shape, run when a `GPTConfig` is validated). A scheme
initialises its own parameters in `reset_parameters` (which `GPT.init_weights` calls) and names
those that are table lookups, with no per-token arithmetic, in `lookup_parameters` (left out of
the FLOP count). A new scheme is one class and one line in `SCHEMES`.

Positions are contiguous unless given: the `T` tokens are at `start`..`start + T - 1` (`start` > 0
when decoding with a KV cache), or, with `ids` (B, T), each row at its own increasing positions
(randomized positions, Ruoss et al. 2023: training on a random ordered subset of [0, L_max) so that
the positions of long inputs are not new at test time). With contiguous ids every scheme gives
exactly what `start` gives (tested). Tables must cover the largest id beforehand (`reserve`).

Caches (the sinusoid table, RoPE's cos/sin) are non-persistent float32 buffers that grow on
demand; nothing is cropped to `block_size`. Only `learned` has a hard limit (`max_positions`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from core.errors import ConfigError
from model.rope import apply_rope, rope_cos_sin, rotated_part

if TYPE_CHECKING:
    from model.config import GPTConfig


class PositionEncoding(nn.Module):
    """Base class: no position information at all (this is also NoPE)."""

    score_bias: bool = False
    """Whether the scheme biases attention scores (`relative_bias`)."""
    learned_bias: bool = False
    """Whether that bias has parameters (a kernel must then carry gradients through it)."""
    uses_positions: bool = True
    """Whether the scheme reads positions at all (NoPE does not)."""
    rescalable: bool = False
    """Whether `config.rope_scaling` applies: its angles can be stretched at evaluation (RoPE)."""
    partial_rotation: bool = False
    """Whether `config.rope_fraction` applies: it can rotate part of each head (RoPE)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.max_positions = self.longest(config)
        """Longest sequence the scheme can encode; None means no limit."""

    @classmethod
    def longest(cls, config: GPTConfig) -> int | None:
        """The longest sequence a model of `config` can encode with this scheme (None: no limit)."""
        return None

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        """Raise `ConfigError` when the scheme cannot work with `config` (called at its validation)."""

    def embed(self, x: Tensor, start: int, ids: Tensor | None = None) -> Tensor:
        """Token embeddings `x` (B, T, C) at positions start..start+T-1 (or `ids`, (B, T)) -> input
        of the first block."""
        return x

    def rotate(self, q: Tensor, k: Tensor, start: int, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Queries and keys (B, H, T, D) at positions start..start+T-1 (or `ids`, (B, T)) -> rotated copies."""
        return q, k

    def relative_bias(self, h: Tensor, distance: Tensor) -> Tensor:
        """Float32 bias for head(s) `h` on a key `distance` = q - k positions before the query
        (broadcasting tensors). Only schemes that declare `score_bias` have one; masking is the kernel's job."""
        raise NotImplementedError(f"{type(self).__name__} has no score bias.")

    def reset_parameters(self) -> None:
        """Initialise the scheme's own parameters (called by `GPT.init_weights`)."""

    def reserve(self, length: int) -> None:
        """Grow any position table to cover `length` positions now, before decoding: a compiled step
        would otherwise be recompiled each time a table grows."""

    def lookup_parameters(self) -> list[nn.Parameter]:
        """Parameters read by lookup, with no per-token multiply-adds: left out of `flops_per_token`."""
        return []


class NoPositions(PositionEncoding):
    """NoPE: no position signal; the causal mask is the only source of order (Kazemnejad et al. 2023)."""

    uses_positions = False


class LearnedPositions(PositionEncoding):
    """One trained vector per absolute position, added to the token embedding (GPT-2)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.table = nn.Embedding(config.block_size, config.n_embd)
        self.reset_parameters()

    @classmethod
    def longest(cls, config: GPTConfig) -> int | None:
        return config.block_size

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table.weight, mean=0.0, std=0.02)  # GPT-2's init

    def lookup_parameters(self) -> list[nn.Parameter]:
        return [self.table.weight]

    def embed(self, x: Tensor, start: int, ids: Tensor | None = None) -> Tensor:
        end = start + x.size(1)
        if ids is None and end > self.table.num_embeddings:
            # GPT.forward checks lengths first with a friendlier message; this guards direct use.
            raise ValueError(
                f"pos_encoding='learned' has embeddings for {self.table.num_embeddings} positions "
                f"(block_size) but position {end - 1} was asked for."
            )
        return x + take(self.table.weight, start, x.size(1), ids)


class SinusoidalPositions(PositionEncoding):
    """The fixed sin/cos table of "Attention Is All You Need" (Vaswani et al. 2017, section 3.5).

    PE[pos, 2i] = sin(pos / 10000^(2i/C)) and PE[pos, 2i+1] = cos(pos / 10000^(2i/C)). As in the
    paper (section 3.4), token embeddings are multiplied by sqrt(C) before the table is added:
    with GPT-2's 0.02 init the tokens would otherwise be drowned by the unit-amplitude table.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.n_embd = config.n_embd
        self.register_buffer("table", sinusoid_table(config.block_size, config.n_embd), persistent=False)

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        _require_even(config, config.n_embd, "pairs sin and cos channels, so n_embd must be even")

    def reserve(self, length: int) -> None:
        if length > self.table.size(0):
            self.table = sinusoid_table(_grown(length), self.n_embd, device=self.table.device)

    def embed(self, x: Tensor, start: int, ids: Tensor | None = None) -> Tensor:
        end = start + x.size(1)
        if (ids is None and end > self.table.size(0)) or self.table.dtype != torch.float32:
            self.table = sinusoid_table(_grown(max(end, self.table.size(0))), self.n_embd, device=x.device)
        return x * math.sqrt(self.n_embd) + take(self.table, start, x.size(1), ids).to(x.dtype)


class RotaryPositions(PositionEncoding):
    """RoPE (Su et al. 2021): rotate each (q, k) dimension pair by an angle proportional to position,
    so that q_m . k_n depends on positions only through m - n.

    Pairs are the two halves of the head (dimension i with i + D/2), as in GPT-NeoX and litgpt.
    Angles and the rotation are computed in float32 whatever the activations' dtype.
    """

    rescalable = True
    partial_rotation = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.head_dim = config.head_dim
        self.rotated_dims, self.pairs = rotated_part(config)
        self.base = config.rope_base
        self.scaling = (config.rope_scaling, config.rope_scaling_factor, config.block_size)
        cos, sin = self._cos_sin(config.block_size)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        why = f"rotates pairs of dimensions, so the head size n_embd / n_head = {config.n_embd} / {config.n_head}"
        _require_even(config, config.head_dim, why + " must be even")
        dims, _ = rotated_part(config)  # a fraction that makes whole pairs
        if config.rope_scaling == "ntk" and dims <= 2:
            raise ConfigError(
                f"GPTConfig.rope_scaling='ntk' scales the base by D / (D - 2) of the {dims} rotated dimensions: "
                "rotate more of them (a larger rope_fraction) or use another rope_scaling."
            )

    def reserve(self, length: int) -> None:
        if length > self.cos.size(0):
            self.cos, self.sin = self._cos_sin(_grown(length), device=self.cos.device)

    def rotate(self, q: Tensor, k: Tensor, start: int, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        end = start + q.size(-2)
        if (ids is None and end > self.cos.size(0)) or self.cos.dtype != torch.float32:
            self.cos, self.sin = self._cos_sin(_grown(max(end, self.cos.size(0))), device=q.device)
        T = q.size(-2)
        cos, sin = take(self.cos, start, T, ids), take(self.sin, start, T, ids)  # (T, D/2), or (B, T, D/2)
        if ids is not None:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D/2): the same positions for every head
        r = self.rotated_dims
        if r == self.head_dim:
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # neox: the first r dimensions rotate, the rest pass through
        return tuple(torch.cat((apply_rope(t[..., :r], cos, sin), t[..., r:]), dim=-1) for t in (q, k))

    def _cos_sin(self, length: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        kind, factor, trained_length = self.scaling
        return rope_cos_sin(length, self.rotated_dims, self.base, device, kind, factor, trained_length, self.pairs)


class ALiBi(PositionEncoding):
    """ALiBi (Press et al. 2022): no position vectors; head h adds -m_h * (i - j) to the score of
    query i on key j, with the paper's head-specific slopes m_h (see `alibi_slopes`)."""

    score_bias = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.n_head = config.n_head
        self.register_buffer("slopes", _alibi_slopes_tensor(config.n_head), persistent=False)

    def _fp32_slopes(self) -> Tensor:
        if self.slopes.dtype != torch.float32:  # e.g. after model.to(torch.bfloat16)
            self.slopes = _alibi_slopes_tensor(self.n_head, device=self.slopes.device)
        return self.slopes

    def relative_bias(self, h: Tensor, distance: Tensor) -> Tensor:
        return -self._fp32_slopes()[h] * distance


class T5Bias(PositionEncoding):
    """T5's relative position bias (Raffel et al. 2020), causal: a learned scalar per head for each
    bucket of the distance d = q - k >= 0. Buckets 0..N/2-1 hold one distance each; the other N/2
    are log-spaced up to `max_distance`, from which on every distance shares the last bucket (so
    the scheme runs at any length). The table is looked up, once per forward for eager and SDPA
    and inside the kernel for flex, and shared by every layer."""

    score_bias = True
    learned_bias = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.num_buckets, self.max_distance = config.t5_num_buckets, config.t5_max_distance
        self.table = nn.Parameter(torch.empty(config.t5_num_buckets, config.n_head))  # (buckets, H)
        distances = torch.arange(config.t5_max_distance + 1)
        self.register_buffer("buckets", t5_bucket(distances, self.num_buckets, self.max_distance), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table, mean=0.0, std=0.02)  # the scale of GPT-2's other weights

    def lookup_parameters(self) -> list[nn.Parameter]:
        return [self.table]

    def relative_bias(self, h: Tensor, distance: Tensor) -> Tensor:
        bucket = self.buckets[distance.clamp(0, self.max_distance)]  # saturates at max_distance
        return self.table[bucket, h].float()


class Kerple(PositionEncoding):
    """KERPLE's logarithmic kernel (Chi et al. 2022), causal: head h adds
    -r1_h * log(1 + r2_h * (i - j)) to the score of query i on key j, with r1_h, r2_h > 0 learned.
    A log-shaped ALiBi whose slope and curvature each head learns; like ALiBi it runs at any length.
    Both are used at least `EPS` (the paper's code clamps the parameters there after each step; here
    the forward pass clamps their values and lets the gradient through unchanged, so that a
    parameter pushed below EPS can come back, and the optimizer and compile see plain parameters)."""

    score_bias = True
    learned_bias = True
    EPS = 1e-2

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.r1 = nn.Parameter(torch.empty(config.n_head))
        self.r2 = nn.Parameter(torch.empty(config.n_head))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # the paper's code: r1 ~ U(0, 2), r2 ~ U(0, 1), per head
        with torch.no_grad():
            self.r1.uniform_(0.0, 2.0)
            self.r2.uniform_(0.0, 1.0)

    def relative_bias(self, h: Tensor, distance: Tensor) -> Tensor:
        r1, r2 = (torch.where(r < self.EPS, self.EPS + (r - r.detach()), r) for r in (self.r1.float(), self.r2.float()))
        # future keys (distance < 0) are masked by the kernel, but their bias must stay finite
        return -r1[h] * torch.log1p(r2[h] * distance.clamp(min=0))


def _require_even(config: GPTConfig, value: int, why: str) -> None:
    if value % 2:
        raise ConfigError(f"GPTConfig.pos_encoding={config.pos_encoding!r} {why}; got {value}.")


def take(table: Tensor, start: int, length: int, ids: Tensor | None) -> Tensor:
    """The rows of a per-position table (N, ...) for `length` tokens: table[start:start+length], or
    table[ids] for positions `ids` (B, T) -> (B, T, ...)."""
    return table[start : start + length] if ids is None else table[ids]


def random_positions(
    batch: int, length: int, bound: int, generator: torch.Generator | None = None, device: torch.device | None = None
) -> Tensor:
    """(batch, length) int64 positions, each row an increasing random subset of [0, bound), all
    subsets equally likely (randomized positions, Ruoss et al. 2023); drawn on the CPU from
    `generator`, so a seed gives the same positions on every device."""
    if not 0 < length <= bound:
        raise ValueError(f"Cannot draw {length} distinct positions from [0, {bound}).")
    keys = torch.rand(batch, bound, generator=generator)
    return keys.topk(length, dim=-1).indices.sort(dim=-1).values.to(device)


def t5_bucket(distance: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's causal (unidirectional) bucket of each distance q - k: the distance itself below
    N/2 = num_buckets // 2, else N/2 + floor(ln(d / (N/2)) / ln(max_distance / (N/2)) * (N - N/2)),
    at most N - 1 (`_relative_position_bucket` of the T5 code with bidirectional=False)."""
    exact = num_buckets // 2
    d = distance.clamp(min=0)
    log_ratio = torch.log(d.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(d < exact, d, large)


def sinusoid_table(length: int, dim: int, device: torch.device | None = None) -> Tensor:
    """(length, dim) float32 table; even channels sin, odd channels cos, of pos / 10000^(2i/dim)."""
    pos = torch.arange(length, dtype=torch.float32, device=device)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / dim))
    table = torch.empty(length, dim, dtype=torch.float32, device=device)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)
    return table


def alibi_slopes(n_head: int) -> list[float]:
    """The ALiBi paper's slopes. For n a power of two, the geometric sequence that starts at and has
    ratio 2^(-8/n). Otherwise take the slopes of the closest smaller power of two n' and add every
    other slope of the sequence for 2n' until there are n (Press et al. 2022, appendix; their code)."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if n_head & (n_head - 1) == 0:
        return power_of_two(n_head)
    closest = 2 ** math.floor(math.log2(n_head))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_head - closest]


def _alibi_slopes_tensor(n_head: int, device: torch.device | None = None) -> Tensor:
    return torch.tensor(alibi_slopes(n_head), dtype=torch.float32, device=device)


def _grown(needed: int) -> int:
    """Cache size for `needed` positions: the next power of two, so that token-by-token growth
    (generation past the training length) rebuilds a cache only log2(n) times."""
    return 1 << (needed - 1).bit_length()


SCHEMES: dict[str, type[PositionEncoding]] = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
    "rope": RotaryPositions,
    "alibi": ALiBi,
    "t5": T5Bias,
    "kerple": Kerple,
    "none": NoPositions,
}
"""The position schemes by `pos_encoding` name."""


def build_positions(config: GPTConfig) -> PositionEncoding:
    """The position scheme that `config.pos_encoding` names (a validated config names one of `SCHEMES`)."""
    return SCHEMES[config.pos_encoding](config)
