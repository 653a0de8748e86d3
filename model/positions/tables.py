"""Schemes that add or rotate by a per-position table: learned, sinusoidal, RoPE; and RoPE's arithmetic: its angles,
how PI, NTK and YaRN stretch them past the training length (docs/model.md), the rotation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from posgpt.core.errors import ConfigError
from posgpt.model.positions.base import PositionEncoding, grown, require_even, take

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


class LearnedPositions(PositionEncoding):
    """A trained vector per absolute position, added to the token embedding (GPT-2)."""

    embeds = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.table = nn.Embedding(config.block_size, config.n_embd)
        self.reset_parameters()

    @classmethod
    def longest(cls, config: GPTConfig) -> int | None:
        return config.block_size

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table.weight, mean=0.0, std=0.02)  # nanoGPT's and HF's (GPT-2's TF code: 0.01)

    def lookup_parameters(self) -> list[nn.Parameter]:
        return [self.table.weight]

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:  # GPT checks the length first
        return x + take(self.table.weight, x.size(1), positions)


class SinusoidalPositions(PositionEncoding):
    """The fixed sin/cos table of Vaswani et al. 2017 (§3.5), added; no parameters. Positions past the training
    length are unseen: expect it to degrade there.

    Token embeddings are multiplied by sqrt(C) first (§3.4): with GPT-2's 0.02 init the unit-amplitude table would
    drown them."""

    embeds = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.n_embd = config.n_embd
        self.register_buffer("table", sinusoid_table(config.block_size, config.n_embd), persistent=False)

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        require_even(config, config.n_embd, "pairs sin and cos channels, so n_embd must be even")

    def reserve(self, length: int, device: torch.device | None = None) -> None:
        if length > self.table.size(0) or self.table.dtype != torch.float32:  # float32 again after model.to(bf16)
            size = grown(max(length, self.table.size(0)))
            self.table = sinusoid_table(size, self.n_embd, device=device or self.table.device)

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        end = x.size(1)
        self.reserve(end if positions is None else 0, x.device)  # given positions: reserved by the caller
        return x * math.sqrt(self.n_embd) + take(self.table, end, positions).to(x.dtype)


class RotaryPositions(PositionEncoding):
    """Queries and keys rotated per head by position-proportional angles (Su et al. 2021; base `rope_base`, float32
    angles), so scores depend on relative position. `rope_fraction` < 1 rotates part of each head: `rope_partial
    p_rope` (default) turns only the fastest fraction of the frequency pairs and leaves the slowest unrotated (p-RoPE,
    Barbero et al. 2025), `neox` rotates the first fraction of the dimensions with frequencies spread over them
    (GPT-NeoX's `rotary_pct`).

    Pairs are dimensions i and i + D/2 (GPT-NeoX, litgpt), D = `GPTConfig.rotary_dim`."""

    rotates = True
    rescalable = True
    partial_rotation = True
    relative = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.head_dim = config.rotary_dim  # the width of the vectors rotate() is handed
        self.rotated_dims, self.pairs = rotated_part(config)
        self.base = config.rope_base
        self.scaling = (config.rope_scaling, config.rope_scaling_factor, config.original_length)  # rope_cos_sin's order
        self.register_buffer("turn", self._turn(config.block_size), persistent=False)
        """(positions, 2, 2, D/2): per position what each half gives each, ((cos, sin), (-sin, cos)) (`apply_rope`)."""

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        why = f"rotates pairs of dimensions, so the head size n_embd / n_head = {config.n_embd} / {config.n_head}"
        if config.rotary_dim != config.head_dim:
            why += f" (here each half of it, attention={config.attention!r})"
        require_even(config, config.rotary_dim, why + " must be even")
        dims, _ = rotated_part(config)  # a fraction that makes whole pairs
        if config.rope_scaling == "ntk" and dims <= 2:
            raise ConfigError(
                f"GPTConfig.rope_scaling='ntk' scales the base by D / (D - 2) of the {dims} rotated dimensions: "
                "rotate more of them (a larger rope_fraction) or use another rope_scaling."
            )

    def reserve(self, length: int, device: torch.device | None = None) -> None:
        if length > self.turn.size(0) or self.turn.dtype != torch.float32:  # float32 again after model.to(bf16)
            self.turn = self._turn(grown(max(length, self.turn.size(0))), device=device or self.turn.device)

    def rotation(self, length: int, positions: Tensor | None = None) -> Tensor:
        """The rows of `turn` at a pass's positions, (T, 2, 2, D/2) or (B, 1, T, 2, 2, D/2): every head's."""
        self.reserve(length if positions is None else 0, self.turn.device)  # given positions: reserved by the caller
        turn = take(self.turn, length, positions)
        return turn if positions is None else turn[:, None]

    def rotate(
        self, q: Tensor, k: Tensor, positions: Tensor | None = None, rotation: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        turn = self.rotation(q.size(-2), positions) if rotation is None else rotation
        both, r = torch.cat((q, k), dim=1), self.rotated_dims  # q and k heads turned at once: half the ops a token
        if r == self.head_dim:
            both = apply_rope(both, turn)
        else:  # neox: the first r dimensions rotate, the rest pass through
            both = torch.cat((apply_rope(both[..., :r], turn), both[..., r:]), dim=-1)
        rq, rk = both.split([q.size(1), k.size(1)], dim=1)
        return rq.to(q.dtype), rk.to(k.dtype)

    def _turn(self, length: int, device: torch.device | None = None) -> Tensor:
        cos, sin = rope_cos_sin(length, self.rotated_dims, self.base, device, *self.scaling, self.pairs)
        return torch.stack((torch.stack((cos, sin), -2), torch.stack((-sin, cos), -2)), -3)


def sinusoid_table(length: int, dim: int, device: torch.device | None = None) -> Tensor:
    """(length, dim) float32 table; even channels sin, odd channels cos, of pos / 10000^(2i/dim)."""
    pos = torch.arange(length, dtype=torch.float32, device=device)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / dim))
    angles = pos * inv_freq
    return torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).flatten(1)  # channels 2i and 2i + 1


def rope_cos_sin(
    length: int,
    head_dim: int,
    base: float,
    device: torch.device | None = None,
    scaling: str = "none",
    factor: float = 1.0,
    trained_length: int = 0,
    pairs: int | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin of the RoPE angles, each (length, head_dim / 2) in float32, scaled (linear, ntk, yarn)
    to cover `factor` times the `trained_length`; yarn's cos and sin are multiplied by 0.1 ln(s) + 1, the
    paper's sqrt(1/t) on both q and k. With `pairs` k, only the k fastest pairs turn (p-RoPE)."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    inv_freq = base**-dims
    mscale = 1.0
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling == "yarn" and factor > 1.0:
        # YaRN: theta_i below the correction range, theta_i / factor above it, ramped linearly between (`linear_ramp`)
        low, high = yarn_correction_range(head_dim, base, trained_length)
        span = max(high - low, 1e-3)  # the reference's guard for low == high
        pair = torch.arange(inv_freq.numel(), dtype=torch.float32, device=inv_freq.device)
        interpolate = ((pair - low) / span).clamp(0.0, 1.0)  # 0: keep theta_i, 1: theta_i / factor
        inv_freq = inv_freq * (1.0 - interpolate) + inv_freq / factor * interpolate
        mscale = 0.1 * math.log(factor) + 1.0
    if pairs is not None:
        inv_freq = torch.where(torch.arange(inv_freq.numel(), device=device) < pairs, inv_freq, 0.0)
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    return torch.cos(angles) * mscale, torch.sin(angles) * mscale


def yarn_correction_range(head_dim: int, base: float, trained_length: int) -> tuple[int, int]:
    """The pairs between which YaRN ramps from keeping a frequency to interpolating it: floor(i(beta_fast = 32))
    and ceil(i(beta_slow = 1)), i(r) = D ln(trained_length / (2 pi r)) / (2 ln b) the pair that turns r times
    within the trained length, clamped to [0, D - 1] (the YaRN code's `find_correction_range`)."""

    def pair_turning(rotations: float) -> float:
        return head_dim * math.log(trained_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(pair_turning(32.0)), 0), min(math.ceil(pair_turning(1.0)), head_dim - 1)


def apply_rope(x: Tensor, turn: Tensor) -> Tensor:
    """Rotate x (..., T, D) pairwise: (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), in float32 (float64 if given
    float64), as the sum over the input half g of x_g turn[g, h], `turn` (..., T, 2, 2, D/2) from
    `RotaryPositions.turn`: the same numbers (x2 (-sin) is -(x2 sin) exactly; a sum of zeros is +0), in two ops."""
    halves = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).unflatten(-1, (2, 1, -1))
    return (halves * turn).sum(-3).flatten(-2).to(x.dtype)


def rotated_part(config: GPTConfig) -> tuple[int, int | None]:
    """(dimensions the rotation spans, frequency pairs that turn: None for all) for `config.rope_fraction`
    and `rope_partial`; refuses a fraction that makes no whole number of pairs."""
    fraction, D = config.rope_fraction, config.rotary_dim
    if fraction == 1.0:
        return D, None
    if config.rope_partial == "p_rope":
        pairs = fraction * D / 2
        if pairs < 1 or abs(pairs - round(pairs)) > 1e-9:
            raise ConfigError(
                f"GPTConfig.rope_fraction {fraction} of the {D // 2} frequency pairs of a head of {D} is {pairs:g} "
                f"pairs: pick k / {D // 2} for a whole number k >= 1 (e.g. {max(1, round(pairs))}/{D // 2})."
            )
        return D, round(pairs)
    dims = fraction * D
    if dims < 2 or abs(dims - round(dims)) > 1e-9 or round(dims) % 2:
        example = max(2, 2 * round(dims / 2))
        raise ConfigError(
            f"GPTConfig.rope_fraction {fraction} with rope_partial='neox' rotates {dims:g} of the head's {D} "
            f"dimensions; it must be an even number >= 2 (pairs): pick 2k / {D} (e.g. {example}/{D})."
        )
    return round(dims), None
