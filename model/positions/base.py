"""The interface every position scheme implements (see `model.positions`), and helpers shared by schemes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from posgpt.core.errors import ConfigError
from posgpt.model.terms import ScoreBias, Term

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


def separate(rows: Tensor) -> list[Tensor]:
    """The rows of `rows` (K, ...) as K tensors of their own: copies, or views where no gradient is taken."""
    if not (torch.is_grad_enabled() and rows.requires_grad):
        return list(rows.unbind(0))
    return [row.clone() for row in rows.unbind(0)]


class PositionEncoding(nn.Module):
    """Base class: no position information at all (this is also NoPE)."""

    terms: frozenset[Term] = frozenset()
    """What its `bias` does to the scores (`model.terms`): `POSITIONS`, a formula of positions (ALiBi), or
    `FROM_SCORES`, a term computed from the scores (CoPE: only a kernel that forms them runs it)."""
    learned_bias: bool = False
    """Whether that bias has parameters (a kernel must then carry gradients through it)."""
    uses_positions: bool = True
    """Whether the scheme reads positions at all (NoPE does not)."""
    relative: bool = False
    """Whether it reads positions only as distances i - j: shifting all of them changes nothing (RoPE, ALiBi)."""
    embeds: bool = False
    """Whether it acts on the token embeddings (`embed`: learned, sinusoidal): once, for every layer."""
    rotates: bool = False
    """Whether it rotates queries and keys (`rotate`: RoPE); Llama 4's QK-norm acts on such layers only."""
    rescalable: bool = False
    """Whether `config.rope_scaling` applies: its angles can be stretched at evaluation (RoPE)."""
    partial_rotation: bool = False
    """Whether `config.rope_fraction` applies: it can rotate part of each head (RoPE)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.max_positions = self.longest(config)

    @classmethod
    def longest(cls, config: GPTConfig) -> int | None:
        """The longest sequence a model of `config` can encode with this scheme (None: no limit)."""
        return None

    @classmethod
    def sized_settings(cls, config: GPTConfig) -> dict[str, Any]:
        """The settings that size its parameters from block_size, as `config` resolves them: what a fine-tune at
        another block_size sets to keep them (CoPE's count table); none for most schemes."""
        return {}

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        """Raise `ConfigError` when the scheme cannot work with `config` (called at its validation)."""

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token embeddings `x` (B, T, C) at `positions` (B or 1, T; None: 0..T-1) -> input of the first block."""
        return x

    def rotation(self, length: int, positions: Tensor | None = None) -> Tensor | None:
        """What `rotate` reads at a pass's positions, taken once for all its layers (None: nothing)."""
        return None

    def rotate(
        self, q: Tensor, k: Tensor, positions: Tensor | None = None, rotation: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Queries and keys (B, H, T, D) at `positions` (B or 1, T; None: 0..T-1), or by their `rotation`, ->
        rotated copies."""
        return q, k

    def bias(self, layer: int = 0) -> ScoreBias:
        """Layer `layer`'s score terms (`terms`) for one forward pass, from the parameters as they are now."""
        raise NotImplementedError(f"{type(self).__name__} has no score bias.")

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
    return torch.rand(batch, bound, generator=generator).topk(length, dim=-1).indices.sort(dim=-1).values.to(device)


def grown(needed: int) -> int:
    """Cache size for `needed` positions: the next power of two (token-by-token growth rebuilds log2(n) times)."""
    return 1 << (needed - 1).bit_length()
