"""RoPE's angles, how each scaling method stretches them past the training length, and the rotation.

`model.positions.RotaryPositions` is the scheme; this is its arithmetic, kept apart because the
scalings (position interpolation, NTK, YaRN) are formulas of their own, each checked by hand in
tests/test_positions.py.
"""

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
    """cos and sin of the RoPE angles, each (length, head_dim / 2) in float32, optionally scaled to
    cover `factor` times the `trained_length`. With D = head_dim, b = base, s = factor and
    theta_i = b^(-2i/D) the frequency of pair i:

    - linear: position interpolation (Chen et al. 2023): theta_i / s for every pair;
    - ntk: the static NTK-aware base (bloc97, 2023): b' = b * s^(D / (D - 2)), so the slowest pair
      is slowed by exactly s and the fastest is untouched;
    - yarn: "NTK-by-parts" with an attention temperature, as the YaRN reference implementation
      (Peng et al. 2023, and Hugging Face's `_compute_yarn_parameters`) computes it: see
      `yarn_inv_freq`; cos and sin are multiplied by 0.1 ln(s) + 1, so every attention score is
      scaled by its square (the paper's sqrt(1/t) on both q and k).
    With factor 1 every method gives the unscaled angles. With `pairs` k, only the k fastest pairs
    turn (p-RoPE: theta_i = 0 for i >= k, so cos 1 and sin 0 leave the rest as they are).
    """
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
    """The pairs between which YaRN ramps from keeping a frequency to interpolating it.

    Pair i turns trained_length * theta_i / (2 pi) times within the trained length, so it turns
    exactly r times at i(r) = D ln(trained_length / (2 pi r)) / (2 ln b). Pairs up to
    floor(i(beta_fast)) turn at least beta_fast = 32 times and keep their frequency; pairs from
    ceil(i(beta_slow)) on turn at most beta_slow = 1 time and are interpolated by the factor
    (`find_correction_range` of the YaRN code, with its truncation and its clamp to [0, D - 1]).
    """
    if trained_length < 1:
        raise ValueError(f"YaRN needs the trained length (block_size), got {trained_length}.")

    def pair_turning(rotations: float) -> float:
        return head_dim * math.log(trained_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(pair_turning(beta_fast)), 0), min(math.ceil(pair_turning(beta_slow)), head_dim - 1)


def yarn_inv_freq(inv_freq: Tensor, head_dim: int, base: float, factor: float, trained_length: int) -> Tensor:
    """YaRN's frequencies: theta_i kept below the correction range, theta_i / factor above it, and a
    blend in between whose weight is linear in the pair index i (the reference code's
    `linear_ramp`), not in the number of rotations."""
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
    """(dimensions the rotation spans, frequency pairs that turn: None for all) of RoPE with
    `config.rope_fraction` of each rotated vector (a head, or what the attention function rotates as
    one: `GPTConfig.rotary_dim`): p_rope spans the whole vector and turns the highest-frequency
    fraction of its D / 2 pairs; neox spans the first fraction x D dimensions and turns all their
    pairs. Refuses, naming the fix, a fraction that makes no whole number of pairs."""
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
