"""Position schemes behind one small interface, and the registry that builds them from a config.

Every scheme implements up to three hooks, each a no-op by default:

- `embed(x, positions)`         adds something to the token embeddings (learned, sinusoidal);
- `rotate(q, k, positions)`     rotates queries and keys per head (RoPE);
- `bias(layer)`               a `ScoreBias` for one forward pass: the formula of a bias on the
  attention score of head h for a query at position i, d positions after its key (ALiBi, T5,
  Kerple read d; FIRE both), over tensors computed from the scheme's parameters. It is written
  once: the dense (H, Tq, Tk) bias of eager and SDPA is the formula on index grids, and
  FlexAttention's `score_mod` calls it inside the fused kernel.

and declares what it is (capabilities that kernels, training and evaluation read, never the
scheme's name): `longest(config)` (None: no limit; the instance's `max_positions`), `score_bias`
and `learned_bias` (a bias on the scores, and whether it has parameters whose gradients a kernel
must carry), `uses_positions` (False for NoPE: nothing to randomize), `rescalable` (its angles can
be stretched past the training length at evaluation: RoPE's PI / NTK / YaRN), and `check(config)`
(what the scheme needs of the model's shape, run when a `GPTConfig` is validated). A scheme
initialises its own parameters in `reset_parameters` (which `GPT.init_weights` calls) and names
those that are table lookups, with no per-token arithmetic, in `lookup_parameters` (left out of
the FLOP count). A new scheme is one class and one line in `SCHEMES`.

The schemes live by kind: `base` (the interface, NoPE), `tables` (learned, sinusoidal, RoPE:
per-position tables added to the embeddings or rotating q and k), `biases` (ALiBi, T5, Kerple,
FIRE: score biases).

Positions are 0..T-1 unless given: `positions` (B, T) puts each row at its own increasing positions
(decoding with a KV cache: each row's cache positions; randomized positions, Ruoss et al. 2023:
training on a random ordered subset of [0, L_max) so that the positions of long inputs are not new
at test time). With positions 0..T-1 given, every scheme gives exactly what None gives (tested).
Tables must cover the largest position beforehand (`reserve`).

Caches (the sinusoid table, RoPE's cos/sin) are non-persistent float32 buffers that grow on
demand; nothing is cropped to `block_size`. Only `learned` has a hard limit (`max_positions`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from model.positions.base import NoPositions, PositionEncoding, ScoreBias, random_positions, separate, take
from model.positions.biases import FIRE, ALiBi, Kerple, T5Bias, alibi_slopes, t5_bucket
from model.positions.tables import LearnedPositions, RotaryPositions, SinusoidalPositions, sinusoid_table

if TYPE_CHECKING:
    from model.config import GPTConfig

SCHEMES: dict[str, type[PositionEncoding]] = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
    "rope": RotaryPositions,
    "alibi": ALiBi,
    "t5": T5Bias,
    "kerple": Kerple,
    "fire": FIRE,
    "none": NoPositions,
}
"""The position schemes by `pos_encoding` name."""


def build_positions(config: GPTConfig) -> PositionEncoding:
    """The position scheme that `config.pos_encoding` names (a validated config names one of `SCHEMES`)."""
    return SCHEMES[config.pos_encoding](config)


__all__ = [
    "FIRE", "SCHEMES", "ALiBi", "Kerple", "LearnedPositions", "NoPositions", "PositionEncoding", "RotaryPositions",
    "ScoreBias", "SinusoidalPositions", "T5Bias", "alibi_slopes", "build_positions", "random_positions", "separate",
    "sinusoid_table", "t5_bucket", "take",
]  # fmt: skip
