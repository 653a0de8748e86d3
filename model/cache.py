"""A key/value cache for decoding: per-layer buffers of fixed capacity, filled left to right.

Keys are stored after the position scheme has rotated them (RoPE), so a cached key never needs
touching again; the queries of new tokens are rotated at their true absolute positions.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerCache:
    """One layer's keys and values, (B, H, capacity, D) each, allocated at first use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Store (B, H, T, D) keys and values at positions start..start+T-1; return all keys and
        values up to the last of them, (B, H, start + T, D)."""
        end = start + k.size(-2)
        if self.k is None or self.k.dtype != k.dtype or self.k.shape[0] != k.shape[0]:
            shape = (k.size(0), k.size(1), self.capacity, k.size(3))
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for the first `length` positions of a batch of sequences."""

    def __init__(self, n_layer: int, capacity: int) -> None:
        self.capacity = capacity
        self.layers = [LayerCache(capacity) for _ in range(n_layer)]
        self.length = 0

    def reset(self) -> None:
        """Forget every position (the buffers are kept and overwritten)."""
        self.length = 0
