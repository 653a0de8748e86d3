"""The interface every position scheme implements (see `model.positions`), and helpers shared by
schemes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from core.errors import ConfigError

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

    def relative_bias(self, h: Tensor, distance: Tensor, query: Tensor) -> Tensor:
        """Float32 bias for head(s) `h` on a key `distance` = q - k positions before a query at
        position `query` (broadcasting tensors; most schemes read the distance only, FIRE both).
        Only schemes that declare `score_bias` have one; masking is the kernel's job."""
        raise NotImplementedError(f"{type(self).__name__} has no score bias.")

    fields: tuple[str, ...] = ()
    """The `GPTConfig` fields the scheme reads beyond the model's shape (`GPT.switch` rebuilds it when
    one of them changes)."""
    bias_layers: int = 1
    """Layers with a bias of their own (1: one bias shared by every layer). With more, layer l's
    heads are numbered from `head_offset(l)` in `relative_bias`, and each layer's kernel context
    is built with its own."""

    def head_offset(self, layer: int) -> Tensor | int:
        """The number of layer `layer`'s first head among the heads `relative_bias` knows."""
        return 0

    def bias_elements(self, n_head: int) -> int:
        """Float32 values `relative_bias` forms per query-key pair for `n_head` heads (the bias, and
        anything larger on the way to it): how many query rows a dense kernel takes at once."""
        return n_head

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


def require_even(config: GPTConfig, value: int, why: str) -> None:
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


def grown(needed: int) -> int:
    """Cache size for `needed` positions: the next power of two, so that token-by-token growth
    (generation past the training length) rebuilds a cache only log2(n) times."""
    return 1 << (needed - 1).bit_length()
