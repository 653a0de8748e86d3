"""Position schemes behind one small interface (`base`: hooks `embed`, `rotate`, `bias`, each a no-op by
default, and declared capabilities, read instead of names), by kind: `tables` (learned, sinusoidal,
RoPE) and `biases` (ALiBi, T5, Kerple, FIRE, CoPE); and `SCHEMES`, the registry. See docs/model.md.

Positions are 0..T-1 unless given: `positions` (B, T) puts each row at its own increasing positions
(a KV cache's, or randomized positions, Ruoss et al. 2023); tables must cover them (`reserve`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posgpt.model.positions.base import NoPositions, PositionEncoding, random_positions, separate, take
from posgpt.model.positions.biases import FIRE, ALiBi, ContextualPositions, Kerple, T5Bias, alibi_slopes, t5_bucket
from posgpt.model.positions.tables import LearnedPositions, RotaryPositions, SinusoidalPositions, sinusoid_table

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig

SCHEMES: dict[str, type[PositionEncoding]] = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
    "rope": RotaryPositions,
    "alibi": ALiBi,
    "t5": T5Bias,
    "kerple": Kerple,
    "fire": FIRE,
    "cope": ContextualPositions,
    "none": NoPositions,
}
"""The position schemes by `pos_encoding` name."""


def build_positions(config: GPTConfig) -> PositionEncoding:
    """The position scheme that `config.pos_encoding` names (a validated config names one of `SCHEMES`)."""
    return SCHEMES[config.pos_encoding](config)


__all__ = [
    "ALiBi", "ContextualPositions", "FIRE", "Kerple", "LearnedPositions", "NoPositions", "PositionEncoding",
    "RotaryPositions", "SCHEMES", "SinusoidalPositions", "T5Bias", "alibi_slopes",
    "build_positions", "random_positions", "separate", "sinusoid_table", "t5_bucket", "take",
]  # fmt: skip
