"""The interface every position scheme implements (see `model.positions`), and helpers shared by schemes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from posgpt.core.errors import ConfigError

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


ScoresTerm = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(queries (B, H, rows, D), their scores (B, H, rows, Tk) with -inf where a key is not visible, the visibility)
-> a term (B, H, rows, Tk) added to the scores: positions that depend on the content (CoPE)."""


@dataclass(frozen=True)
class ScoreBias:
    """One layer's position bias on the scores, for one forward pass: `formula(h, distance, query)`, the
    float32 bias of head(s) `h` for a key `distance` = i - j before a query at position i (broadcasting
    tensors), called on index grids by eager and SDPA and inside FlexAttention's score_mod.

    The formula reads tensors computed beforehand, each on its own and through one index by head:
    compiled FlexAttention refuses a gradient tensor read twice or transformed inside a score_mod
    (`validate_joint_graph`, torch 2.11 to 2.13), and gives a view of a parameter no gradient (`separate`)."""

    formula: Callable[[Tensor, Tensor, Tensor], Tensor] | None
    elements: int
    """Float32 values the formula forms per query-key pair for all heads: sizes a dense kernel's row blocks."""
    kernel_options: dict[str, int] | None = None
    """FlexAttention's tile options on CUDA, for a formula that does not fit the default tiles' shared memory."""
    from_scores: ScoresTerm | None = None
    """A term computed from the scores themselves (`PositionEncoding.contextual`), added where they are formed."""

    def __call__(self, h: Tensor, distance: Tensor, query: Tensor) -> Tensor:
        assert self.formula is not None
        return self.formula(h, distance, query)


def separate(rows: Tensor) -> list[Tensor]:
    """The rows of `rows` (K, ...) as K tensors of their own: copies, or views where no gradient is taken."""
    if not (torch.is_grad_enabled() and rows.requires_grad):
        return list(rows.unbind(0))
    return [row.clone() for row in rows.unbind(0)]


class PositionEncoding(nn.Module):
    """Base class: no position information at all (this is also NoPE)."""

    score_bias: bool = False
    """Whether the scheme biases attention scores (`bias`)."""
    learned_bias: bool = False
    """Whether that bias has parameters (a kernel must then carry gradients through it)."""
    uses_positions: bool = True
    """Whether the scheme reads positions at all (NoPE does not)."""
    contextual: bool = False
    """Whether its bias is computed from the scores (`ScoreBias.from_scores`): only a kernel that forms them runs it."""
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

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token embeddings `x` (B, T, C) at `positions` (B or 1, T; None: 0..T-1) -> input of the first block."""
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Queries and keys (B, H, T, D) at `positions` (B or 1, T; None: 0..T-1) -> rotated copies."""
        return q, k

    def bias(self, layer: int = 0) -> ScoreBias:
        """Layer `layer`'s score bias for one forward pass, from the parameters as they are now."""
        raise NotImplementedError(f"{type(self).__name__} has no score bias.")

    fields: tuple[str, ...] = ()
    """The `GPTConfig` fields the scheme reads beyond the model's shape (`GPT.switch` rebuilds it on a change)."""
    bias_layers: int = 1
    """Layers with a bias of their own (1: one bias shared by every layer)."""

    def reset_parameters(self) -> None:
        """Initialise the scheme's own parameters (called by `GPT.init_weights`)."""

    def reserve(self, length: int) -> None:
        """Grow any position table to cover `length` positions now, before a compiled decode step needs them."""

    def lookup_parameters(self) -> list[nn.Parameter]:
        """Parameters read by lookup, with no per-token multiply-adds: left out of `flops_per_token`."""
        return []


class NoPositions(PositionEncoding):
    """NoPE: no position signal; the causal mask is the only source of order (Kazemnejad et al. 2023)."""

    uses_positions = False


def require_even(config: GPTConfig, value: int, why: str) -> None:
    if value % 2:
        raise ConfigError(f"GPTConfig.pos_encoding={config.pos_encoding!r} {why}; got {value}.")


def take(table: Tensor, length: int, positions: Tensor | None) -> Tensor:
    """The rows of a per-position table (N, ...) for `length` tokens: table[:length] (T, ...), or
    table[positions] for `positions` (B, T) -> (B, T, ...)."""
    return table[:length] if positions is None else table[positions]


def random_positions(
    batch: int, length: int, bound: int, generator: torch.Generator | None = None, device: torch.device | None = None
) -> Tensor:
    """(batch, length) int64 positions, each row a uniformly drawn increasing subset of [0, bound), drawn
    on the CPU from `generator`, so a seed gives the same positions on every device."""
    if not 0 < length <= bound:
        raise ValueError(f"Cannot draw {length} distinct positions from [0, {bound}).")
    keys = torch.rand(batch, bound, generator=generator)
    return keys.topk(length, dim=-1).indices.sort(dim=-1).values.to(device)


def grown(needed: int) -> int:
    """Cache size for `needed` positions: the next power of two (token-by-token growth rebuilds log2(n) times)."""
    return 1 << (needed - 1).bit_length()
