"""What decoding keeps, in tensors of fixed shape: a KV cache shaped by the model's attention mask.

Every tensor a decode step reads or changes (each row's next position `pos`, each slot's position
`slot_positions`, -1 when empty, the keys and values (B, H, C, D) per layer) is allocated once, so
every step has the same shapes and Python path: one compiled graph (one CUDA graph), as in gpt-fast.
Keys are stored rotated. Full causal attention puts position p in slot p; a window of W keys with S
sinks rolls over C = S + W slots (p < S in slot p, any other in slot S + (p - S) mod W); a chunked mask
of chunk C over C slots (p in slot p mod C).

A forward pass through the cache is one `CacheWrite` (`begin`, then `commit` after the last layer):
a prefill into an empty cache (prompts padded on the right, attending to each other), or a step
whose new tokens attend to the buffer (one token: written first; several: the buffer as it was plus
themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posgpt.model.masks import AttentionMask


@dataclass(frozen=True)
class CacheWrite:
    """One forward pass through a cache: where its T new tokens sit and what they attend over."""

    prefill: bool
    """The cache was empty: the new tokens attend to each other only, at positions 0..T-1."""
    positions: Tensor
    """(B, T) position of each new token (in prefill the padding's too: the column)."""
    real: Tensor | None
    """(B, T) which new tokens are real, not padding (None: all)."""
    end: Tensor
    """(B,) each row's next position after this step."""
    k_pos: Tensor | None = None
    """(B, Tk) positions of the keys the new tokens attend over, -1 for an empty slot (None in prefill)."""
    slot_pos: Tensor | None = None
    """(B, C) the position each slot holds after this step (None in a one-token step: written at `begin`)."""
    incoming: Tensor | None = None
    """(B, C) whether a slot takes a new key in this step; `source`: which of the T it takes (None: one token)."""
    source: Tensor | None = None
    rows: tuple[Tensor, Tensor] | None = None
    """A one-token step's (batch rows, their slots), (B,) each: every layer writes its key and value there at once."""


class CachePart:
    """What decoding keeps for the layers of one kind (`model.layout`; a model without one: every layer): a store per
    layer (`layers`), each allocated with `allocate(batch, dtype, device)` in the shapes its part was built for. A
    running state (linear attention's, the delta rule's) needs nothing of a step but its rows' positions."""

    def __init__(self, layers: list) -> None:
        self.layers = layers

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        for layer in self.layers:
            layer.allocate(batch, dtype, device)

    def begin(self, write: CacheWrite, pos: Tensor | None) -> CacheWrite:
        """This part's view of a step (`DecodingCache.begin`'s `write`; `pos`: each row's next position before it)."""
        return write

    def commit(self, write: CacheWrite) -> None:
        """After every layer took the step."""


class DecodingCache:
    """What decoding keeps: each row's next position (`pos`, one for every layer) and each kind's part (`parts`, in the
    order of the model's kinds: its keys and values in slots shaped by its mask, or its running states); `layers`:
    each layer's store, in order (`order`: each layer's part)."""

    def __init__(self, parts: list[CachePart], order: list[int]) -> None:
        self.pos: Tensor | None = None
        """(B,) position of each row's next token."""
        self.empty = True
        """Nothing stored yet: the next forward is a prefill."""
        self.parts = parts
        stores = [iter(part.layers) for part in parts]
        self.layers = [next(stores[part]) for part in order]

    def reset(self) -> None:
        """Forget every position (the buffers are kept and overwritten by the next prefill)."""
        self.empty = True

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate every tensor decoding changes now, for `batch` rows (static for a CUDA graph)."""
        self.pos = static_buffer(torch.zeros(batch, dtype=torch.long, device=device))
        for part in self.parts:
            part.allocate(batch, dtype, device)

    def begin(self, batch: int, new_tokens: int, lengths: Tensor | None, device: torch.device) -> list[CacheWrite]:
        """The step of a forward pass of `new_tokens` tokens per row (`lengths`: the real ones, in a prefill), as each
        part sees it."""
        write = self._step(batch, new_tokens, lengths, device)
        return [part.begin(write, self.pos) for part in self.parts]

    def _step(self, batch: int, new_tokens: int, lengths: Tensor | None, device: torch.device) -> CacheWrite:
        if not self.empty and new_tokens == 1 and lengths is None:  # a decode step: its positions a view of `pos`,
            assert self.pos is not None  # read by the layers only, before `commit` moves it
            return CacheWrite(False, self.pos[:, None], None, self.pos + 1)
        offsets = torch.arange(new_tokens, device=device)
        if self.empty:
            end = lengths if lengths is not None else torch.full((batch,), new_tokens, device=device)
            real = offsets[None, :] < lengths[:, None] if lengths is not None else None
            return CacheWrite(True, offsets[None, :].expand(batch, -1), real, end)
        if lengths is not None:
            raise ValueError("Padded prompts (lengths) go into an empty cache: reset it first.")
        assert self.pos is not None
        return CacheWrite(False, self.pos[:, None] + offsets, None, self.pos + new_tokens)

    def commit(self, writes: list[CacheWrite]) -> None:
        """After every layer took the step: each part's, then the rows move on."""
        for part, write in zip(self.parts, writes, strict=True):
            part.commit(write)
        end = writes[0].end
        if self.pos is None or self.pos.shape != end.shape:
            self.pos = end.clone()
        else:
            self.pos.copy_(end)
        self.empty = False


class KVCache(CachePart):
    """Keys and values of a kind's layers, in fixed buffers (see the module docstring), `heads` KV heads of
    `head_dim`; `layer`: a layer's store (`n_head`: the query heads, for what a store keeps per query head)."""

    def __init__(
        self, n_layer: int, capacity: int, heads: int, head_dim: int, n_head: int, mask: AttentionMask | None = None,
        layer: type[LayerCache] | None = None,
    ) -> None:  # fmt: skip
        self.mask = mask or AttentionMask()
        self.rolling = self.mask.rolling
        self.capacity = self.mask.ring + self.mask.sinks if self.rolling else capacity
        """Keys held at most: a rolling cache's S + W (a chunked one's C), else the longest sequence it takes."""
        self.heads, self.head_dim, self.n_head = heads, head_dim, n_head
        self.slot_positions: Tensor | None = None
        """(B, C) the position each slot holds (-1: empty)."""
        self.rows: Tensor | None = None
        """(B,) 0..B-1, made once: a decode step makes no tensor it can keep."""
        super().__init__([(layer or LayerCache)(self) for _ in range(n_layer)])

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        super().allocate(batch, dtype, device)
        self.slot_positions = static_buffer(torch.full((batch, self.capacity), -1, dtype=torch.long, device=device))
        self.rows = static_buffer(torch.arange(batch, device=device))

    def begin(self, write: CacheWrite, pos: Tensor | None) -> CacheWrite:
        batch, new_tokens, device = write.end.size(0), write.positions.size(1), write.end.device
        if self.slot_positions is None or self.slot_positions.size(0) != batch:
            self.slot_positions = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)
            self.rows = torch.arange(batch, device=device)
        # one key per row, written first: its slot now holds it (not checked against the capacity: `generate` never
        # asks for a position past it, and a check would cost every step a device wait)
        if new_tokens == 1 and not write.prefill:
            assert self.rows is not None and pos is not None
            slot = self.slot_of(pos)
            self.slot_positions[self.rows, slot] = pos
            return CacheWrite(False, write.positions, None, write.end, self.slot_positions, rows=(self.rows, slot))
        # refuse positions past a full cache's capacity, which it would drop
        end = new_tokens if write.prefill and write.real is None else None
        if not write.prefill and not self.rolling and not torch.compiler.is_compiling():
            end = int(write.end.max())
        if not self.rolling and end is not None and end > self.capacity:
            raise ValueError(f"The KV cache holds {self.capacity} positions; {end} do not fit (new_cache(capacity)).")
        start = write.end - write.real.sum(-1) if write.real is not None else write.end - new_tokens
        # for positions start[b]..end[b]-1 written into row b: the newest position each slot takes and whether it
        # takes one, (B, C) each
        slots = torch.arange(self.capacity, device=start.device)[None, :]
        position = slots.expand(start.size(0), -1)
        if self.rolling:  # slot s >= S holds the positions p >= S with p = s mod W: the newest is
            last = write.end[:, None] - 1  # last - (last - s) mod W
            rolled = last - torch.remainder(last - slots, self.mask.ring)
            position = torch.where(slots < self.mask.sinks, position, rolled)
        incoming = (position >= start[:, None]) & (position < write.end[:, None])
        if self.rolling:  # a slot past the sinks takes no position below them (without rolling: position = slot)
            incoming = incoming & ((slots < self.mask.sinks) | (position >= self.mask.sinks))
        held = self.slot_positions if not write.prefill else torch.full_like(self.slot_positions, -1)
        slot_pos = torch.where(incoming, position, held)
        if write.prefill:
            k_pos = None  # the new tokens attend to each other only
        elif self.rolling and new_tokens > 1:  # the buffer as it was, then the new keys
            k_pos = torch.cat([held, write.positions], dim=1)
        else:  # written first: the buffer holds every key the new tokens see
            k_pos = slot_pos
        source = position - start[:, None]
        return CacheWrite(write.prefill, write.positions, write.real, write.end, k_pos, slot_pos, incoming, source)

    def commit(self, write: CacheWrite) -> None:
        assert self.slot_positions is not None
        if write.slot_pos is not None:  # a decode step's were written at its begin
            self.slot_positions.copy_(write.slot_pos)

    def slot_of(self, position: Tensor) -> Tensor:
        if not self.rolling:
            return position
        sinks = self.mask.sinks
        return torch.where(position < sinks, position, sinks + torch.remainder(position - sinks, self.mask.ring))


class LayerCache:
    """One layer's keys and values, (B, H_kv, C, D) each: the two halves of one buffer (`kv`, (2, B, H_kv, C, D)),
    so that a one-token step writes both with one op, allocated up front or at first use. No view of it is kept:
    a compiled step would take it as an input aliasing `kv`, and torch 2.11 then runs no CUDA graph."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.kv: Tensor | None = None

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer(batch, self.owner.heads, self.owner.head_dim, dtype, device)

    def buffer(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """`kv` for `batch` rows of `heads` heads of `head_dim`."""
        self.kv = static_buffer(torch.zeros(2, batch, heads, self.owner.capacity, head_dim, dtype=dtype, device=device))

    def update(self, k: Tensor, v: Tensor, write: CacheWrite) -> tuple[Tensor, Tensor]:
        """Store the (B, H_kv, T, D) new keys and values; those the new tokens attend over."""
        B, H, T, D = k.shape
        if self.kv is None or self.kv.dtype != k.dtype or self.kv.shape[1:3] != (B, H) or self.kv.size(-1) != D:
            self.buffer(B, H, D, k.dtype, k.device)
        assert self.kv is not None
        if write.prefill and not self.owner.rolling and T <= self.kv.size(3):  # slot = position: the first T slots
            self.kv[:, :, :, :T] = torch.stack([k, v])  # a padded row's slots past its length stay unseen (-1)
            return k, v
        held_k, held_v = self.kv.unbind(0)
        if write.rows is not None:  # one key per row, into its slot, in place (an index_put_ Inductor keeps so)
            self.kv[:, write.rows[0], :, write.rows[1]] = torch.stack([k, v], dim=1).view(B, 2, H, D)
            return held_k, held_v
        assert write.source is not None and write.incoming is not None
        if write.prefill:  # the new tokens attend to each other only
            attended = k, v
        elif self.owner.rolling:  # the buffer as it was, then the new keys
            attended = torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2)
        else:  # written first: the buffer holds every key the new tokens see
            attended = held_k, held_v
        index = write.source.clamp(0, T - 1)[:, None, :, None].expand(B, H, -1, D)
        take = write.incoming[:, None, :, None]
        held_k.copy_(torch.where(take, k.gather(2, index), held_k))
        held_v.copy_(torch.where(take, v.gather(2, index), held_v))
        return attended


def kept(held: Tensor | None, value: Tensor) -> Tensor:
    """`value` copied into `held`, a buffer a compiled step keeps, where their shapes and dtypes agree (returns
    `held`); else `value` itself, which takes its place."""
    if held is None or held.shape != value.shape or held.dtype != value.dtype:
        return value
    return held.copy_(value)


def static_buffer(tensor: Tensor) -> Tensor:
    """Mark a buffer that decoding changes in place as static for CUDA graphs."""
    if tensor.device.type == "cuda":
        torch._dynamo.mark_static_address(tensor)
    return tensor
