"""The interface every position scheme implements (see `model.positions`), and helpers shared by
schemes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from core.errors import ConfigError

if TYPE_CHECKING:
    from model.config import GPTConfig


@dataclass(frozen=True)
class ScoreBias:
    """One layer's position bias on the attention scores, for one forward pass. `formula(h, distance,
    query)` is the float32 bias of head(s) `h` (numbered within the layer) for keys `distance` = i - j
    positions before a query at position `query` = i (broadcasting tensors; most schemes read the
    distance only, FIRE both). It is written once: eager and SDPA call it on index grids for a dense
    (H, Tq, Tk) bias, FlexAttention's score_mod inside the fused kernel; masking is the kernel's job.

    The formula reads tensors that the scheme computed from its parameters when it built this bias
    (`PositionEncoding.bias`), each stored on its own and read through one index by head. Compiled
    FlexAttention carries a gradient into a tensor its score_mod reads only that way (torch 2.11 to
    2.13): it refuses a tensor read twice or transformed inside the score_mod (`validate_joint_graph`
    in torch/_inductor/kernel/flex/flex_attention.py; seen on an H200 for Kerple and FIRE, and run
    on a CPU by tests/test_kernels.py), and a view of a parameter gets no gradient at all, silently
    (`separate`)."""

    formula: Callable[[Tensor, Tensor, Tensor], Tensor]
    elements: int
    """Float32 values the formula forms per query-key pair for all the layer's heads (the bias, and
    anything larger on the way to it): how many query rows a dense kernel takes at once."""
    kernel_options: dict[str, int] | None = None
    """FlexAttention's tile options on CUDA (`FlexKernelOptions`: BLOCK_M, BLOCK_N, num_stages) for a
    formula whose intermediate tiles do not fit the default tiles' shared memory."""

    def __call__(self, h: Tensor, distance: Tensor, query: Tensor) -> Tensor:
        return self.formula(h, distance, query)


def separate(rows: Tensor) -> list[Tensor]:
    """The rows of `rows` (K, ...) as K tensors of their own (copies, not views), for a `ScoreBias`
    formula to read each one once; views where no gradient is taken (decoding: no copies per step)."""
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
        """Layer `layer`'s score bias for one forward pass (the same for every layer unless
        `bias_layers` > 1), computed from the parameters as they are now. Only schemes that declare
        `score_bias` have one."""
        raise NotImplementedError(f"{type(self).__name__} has no score bias.")

    fields: tuple[str, ...] = ()
    """The `GPTConfig` fields the scheme reads beyond the model's shape (`GPT.switch` rebuilds it when
    one of them changes)."""
    bias_layers: int = 1
    """Layers with a bias of their own (1: one bias shared by every layer); each layer's kernel
    context is then built with its own `bias(layer)`."""

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


def take(table: Tensor, length: int, positions: Tensor | None) -> Tensor:
    """The rows of a per-position table (N, ...) for `length` tokens: table[:length] (T, ...), or
    table[positions] for `positions` (B, T) -> (B, T, ...)."""
    return table[:length] if positions is None else table[positions]


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
