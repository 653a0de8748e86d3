"""A key/value cache for decoding, shaped by the model's attention mask.

Keys are stored after the position scheme has rotated them (RoPE), so a cached key never needs
touching again; the queries of new tokens are rotated at their true absolute positions.

- Full causal attention: per-layer buffers of fixed capacity, filled left to right; the keys of a
  step are positions 0..end-1.
- A sliding window of W keys with S sinks (`AttentionMask`): a rolling buffer of S + W slots.
  Position p < S lives in slot p, any other in slot S + (p - S) mod W, so memory stays constant
  however long decoding runs. A step attends over the held slots and its own new keys (their
  positions, -1 for an empty slot, go into the mask); afterwards the new keys that a later query
  can still see replace the oldest ones.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.masks import AttentionMask


class KVCache:
    """Keys and values of every layer, for the tokens seen so far (`length` of them)."""

    def __init__(self, n_layer: int, capacity: int, mask: AttentionMask | None = None) -> None:
        self.mask = mask or AttentionMask()
        self.rolling = not self.mask.causal_only
        self.capacity = self.mask.window + self.mask.sinks if self.rolling else capacity
        """Keys held at most: a rolling cache's S + W, else the longest sequence it takes."""
        self.length = 0
        """Tokens seen: the absolute position of the next one."""
        self.slot_positions: Tensor | None = None
        """Rolling cache: the position each slot holds (-1: empty)."""
        self.layers = [LayerCache(self) for _ in range(n_layer)]

    def reset(self) -> None:
        """Forget every position (the buffers are kept and overwritten)."""
        self.length = 0
        if self.slot_positions is not None:
            self.slot_positions.fill_(-1)

    def allocate(self, batch: int, n_head: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate every layer's buffers now, as gpt-fast's static cache does: a compiled decoding
        step then sees the same buffers from its first call on and is not recompiled when they
        would otherwise appear."""
        for layer in self.layers:
            layer.allocate((batch, n_head, self.capacity, head_dim), dtype, device)
        if self.rolling:
            self._slots(device)

    def fits(self, new_tokens: int) -> bool:
        return self.rolling or self.length + new_tokens <= self.capacity

    def key_positions(self, new_tokens: int, device: torch.device) -> Tensor | None:
        """The absolute positions of the keys the next step attends over (None: 0..length + new - 1)."""
        if not self.rolling:
            return None
        held = self._slots(device)
        return torch.cat([held, torch.arange(self.length, self.length + new_tokens, device=device)])

    def advance(self, new_tokens: int) -> None:
        """After every layer stored a step's keys: move on by `new_tokens` positions."""
        if self.rolling:
            assert self.slot_positions is not None
            positions, slots = self.surviving(new_tokens, self.slot_positions.device)
            self.slot_positions[slots] = positions
        self.length += new_tokens

    def surviving(self, new_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Of the next `new_tokens` positions, those a later query can still see, and their slots.
        One new token always survives (it is the newest): no filtering, so a compiled decoding step
        has no data-dependent shape."""
        positions = torch.arange(self.length, self.length + new_tokens, device=device)
        if new_tokens > 1:
            positions = positions[self.mask.keeps(positions, self.length + new_tokens)]
        sinks, window = self.mask.sinks, self.mask.window
        slots = torch.where(positions < sinks, positions, sinks + (positions - sinks) % window)
        return positions, slots

    def _slots(self, device: torch.device) -> Tensor:
        if self.slot_positions is None:
            self.slot_positions = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        return self.slot_positions


class LayerCache:
    """One layer's keys and values, (B, H, capacity, D) each, allocated up front (`KVCache.allocate`)
    or at first use."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def allocate(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Store the (B, H, T, D) keys and values of positions start..start+T-1 and return the keys
        and values this step attends over (those `KVCache.key_positions` describes)."""
        owner = self.owner
        if self.k is None or self.k.dtype != k.dtype or self.k.shape[0] != k.shape[0]:
            self.allocate((k.size(0), k.size(1), owner.capacity, k.size(3)), k.dtype, k.device)
        assert self.k is not None and self.v is not None
        if not owner.rolling:
            end = start + k.size(-2)
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)  # held slots, then the new
        positions, slots = owner.surviving(k.size(-2), k.device)
        self.k[:, :, slots] = k[:, :, positions - start]
        self.v[:, :, slots] = v[:, :, positions - start]
        return keys, values
