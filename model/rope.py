"""RoPE's arithmetic for `model.positions.RotaryPositions`: the angles, how each scaling method (PI, NTK,
YaRN; docs/model.md has the formulas) stretches them past the training length, and the rotation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from core.errors import ConfigError

if TYPE_CHECKING:
    from model.config import GPTConfig


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
        inv_freq = yarn_inv_freq(inv_freq, head_dim, base, factor, trained_length)
        mscale = 0.1 * math.log(factor) + 1.0
    if pairs is not None:
        inv_freq = torch.where(torch.arange(inv_freq.numel(), device=device) < pairs, inv_freq, 0.0)
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    return torch.cos(angles) * mscale, torch.sin(angles) * mscale


def yarn_correction_range(
    head_dim: int, base: float, trained_length: int, beta_fast: float = 32.0, beta_slow: float = 1.0
) -> tuple[int, int]:
    """The pairs between which YaRN ramps from keeping a frequency to interpolating it: floor(i(beta_fast))
    and ceil(i(beta_slow)), i(r) = D ln(trained_length / (2 pi r)) / (2 ln b) the pair that turns r times
    within the trained length, clamped to [0, D - 1] (the YaRN code's `find_correction_range`)."""
    if trained_length < 1:
        raise ValueError(f"YaRN needs the trained length (block_size), got {trained_length}.")

    def pair_turning(rotations: float) -> float:
        return head_dim * math.log(trained_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(pair_turning(beta_fast)), 0), min(math.ceil(pair_turning(beta_slow)), head_dim - 1)


def yarn_inv_freq(inv_freq: Tensor, head_dim: int, base: float, factor: float, trained_length: int) -> Tensor:
    """YaRN's frequencies: theta_i below the correction range, theta_i / factor above it, blended in between
    linearly in the pair index (the reference code's `linear_ramp`)."""
    low, high = yarn_correction_range(head_dim, base, trained_length)
    span = max(high - low, 1e-3)  # the reference's guard for low == high
    pairs = torch.arange(inv_freq.numel(), dtype=torch.float32, device=inv_freq.device)
    interpolate = ((pairs - low) / span).clamp(0.0, 1.0)  # 0: keep theta_i, 1: theta_i / factor
    return inv_freq * (1.0 - interpolate) + inv_freq / factor * interpolate


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (..., T, D) pairwise: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (..., T, D/2) each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


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
