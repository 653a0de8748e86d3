"""Where attention goes: the weights of every layer and head, recomputed on the reference path, and
three statistics of them that explain what a position scheme does past its training length.

The fused kernels never form the attention weights, so `GPT.attention_weights` recomputes them in
float32 on the eager reference kernel from the same parameters (softmax over the visible keys; for
linear attention the normalised kernel products) and hands them over in chunks of query rows. The
statistics are accumulated chunk by chunk, so no (layers, heads, T, T) tensor is ever formed:

- **mass by distance**: the mean weight that a query gives the key `d` positions back, over every
  query that has such a key (ALiBi's decays with d, NoPE's spreads out, a window's stops at W);
- **entropy by query position**: -sum_j p_ij log p_ij of each query's weights (log(i + 1) for
  uniform attention over the i + 1 keys it sees), which grows when attention diffuses;
- **sink mass by query position**: the weight on the first `sink_tokens` keys (attention sinks,
  Xiao et al. 2023);
- **sink rate** per layer (Gu et al., ICLR 2025): the share of its heads whose mean weight on the
  first token, over every query, exceeds a threshold (0.3 as in the paper), with each head's mean.

For linear attention with RoPE the weights have a rotated numerator and can be negative: its
entropy is that of |w| normalised per row.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from model.gpt import GPT
from model.kernels import WeightsHook

SINK_RATE_THRESHOLD = 0.3
"""Gu et al.'s epsilon: a head whose mean first-token weight exceeds it counts as a sink head."""
PER_OCTAVE = 4
"""Buckets per doubling of distance or position in the summaries (log-spaced: the plots are log-x)."""


def log_edges(n: int, per_octave: int = PER_OCTAVE) -> list[int]:
    """Bucket edges over 0..n-1, log-spaced: [0, 1, 2, ..., 7, 9, 11, 13, 15, 19, 22, ...] (each
    integer at first, `per_octave` buckets per doubling later); the last edge is n."""
    edges = {0, n}
    x = 1.0
    while x < n:
        edges.add(int(x))
        x *= 2 ** (1 / per_octave)
    return sorted(edges)


def bucket_means(values: np.ndarray, edges: list[int]) -> np.ndarray:
    """Mean of `values` (..., n) over each bucket [edges[b], edges[b + 1])."""
    return np.stack([values[..., lo:hi].mean(-1) for lo, hi in zip(edges[:-1], edges[1:], strict=True)], axis=-1)


def distance_sums(weights: Tensor, rows: slice) -> Tensor:
    """sum over batch and queries of the weight at each distance d = i - j: (H, Tk) from weights
    (B, H, rows, Tk) of the queries at positions `rows` (keys at 0..Tk-1)."""
    q_pos = torch.arange(rows.start, rows.stop, device=weights.device)
    distance = q_pos[:, None] - torch.arange(weights.size(-1), device=weights.device)[None, :]  # (rows, Tk)
    w = weights.sum(0).masked_fill(distance < 0, 0.0)  # (H, rows, Tk): keys after the query carry nothing
    sums = w.new_zeros(w.size(0), weights.size(-1))
    return sums.index_add_(1, distance.clamp(min=0).flatten(), w.flatten(1))


def row_entropy(weights: Tensor) -> Tensor:
    """Entropy (nats) of each row of weights (..., Tk): -sum p log p with p = |w| / sum |w|."""
    p = weights.abs()
    p = p / p.sum(-1, keepdim=True)
    return -torch.special.xlogy(p, p).sum(-1)


@dataclass
class LayerSums:
    """What one layer's chunks add up to, per head: weight by distance, and entropy and sink mass by
    query position, each summed over windows."""

    distance: Tensor
    entropy: Tensor
    sink: Tensor
    first: Tensor
    """Weight on the first key, by query position (for the sink rate)."""


class AttentionStats:
    """Accumulates the statistics of every layer over windows of one length; `hook(layer)` is the
    `visit` of `GPT.attention_weights`."""

    def __init__(self, n_layer: int, n_head: int, length: int, sink_tokens: int, device: torch.device) -> None:
        self.length, self.sink_tokens, self.windows = length, sink_tokens, 0
        self.layers = [
            LayerSums(*(torch.zeros(n_head, length, dtype=torch.float64, device=device) for _ in range(4)))
            for _ in range(n_layer)
        ]

    def hook(self, layer: int) -> WeightsHook:
        def add(rows: slice, weights: Tensor) -> None:
            sums = self.layers[layer]
            sums.distance += distance_sums(weights, rows).double()
            sums.entropy[:, rows] += row_entropy(weights).sum(0).double()
            sums.sink[:, rows] += weights[..., : self.sink_tokens].sum(-1).sum(0).double()
            sums.first[:, rows] += weights[..., 0].sum(0).double()

        return add

    def add_windows(self, model: GPT, windows: Tensor) -> None:
        """Run `windows` (B, length) token ids through `model`, adding their attention to the sums."""
        model.attention_weights(windows, self.hook)
        self.windows += windows.size(0)

    def summary(self) -> dict[str, Any]:
        """Per layer and head, bucketed (log-spaced) means over windows and queries:
        {"distance": {"edges", "mean_weight"}, "position": {"edges", "entropy", "sink_mass"}} where
        mean_weight / entropy / sink_mass are [layer][head][bucket]."""
        n = self.length
        edges = log_edges(n)
        queries_at = (n - np.arange(n)) * self.windows  # queries that have a key d back, over windows
        distance = np.stack([s.distance.cpu().numpy() for s in self.layers]) / queries_at
        entropy = np.stack([s.entropy.cpu().numpy() for s in self.layers]) / self.windows
        sink = np.stack([s.sink.cpu().numpy() for s in self.layers]) / self.windows
        first = np.stack([s.first.cpu().numpy() for s in self.layers]).mean(-1) / self.windows  # (layers, heads)
        return {
            "windows": self.windows,
            "sink_tokens": self.sink_tokens,
            "sink_rate": sink_rate(first),
            "distance": {"edges": edges, "mean_weight": _rounded(bucket_means(distance, edges))},
            "position": {
                "edges": edges,
                "entropy": _rounded(bucket_means(entropy, edges)),
                "sink_mass": _rounded(bucket_means(sink, edges)),
            },
        }


def sink_rate(first_mass: np.ndarray, threshold: float = SINK_RATE_THRESHOLD) -> dict[str, Any]:
    """Gu et al.'s sink rate from each head's mean first-token weight (layers, heads): per layer and
    over the model, the share of heads above `threshold`."""
    sinks = first_mass > threshold
    return {"threshold": threshold, "per_layer": _rounded(sinks.mean(-1)), "model": float(f"{sinks.mean():.6g}"),
            "first_token_mass": _rounded(first_mass)}  # fmt: skip


def _rounded(values: np.ndarray) -> list:
    return np.vectorize(lambda v: float(f"{v:.6g}"))(values).tolist()


def windows_of(tokens: np.ndarray, length: int, count: int, batch: int) -> Iterator[Tensor]:
    """The first `count` non-overlapping windows of `length` tokens, `batch` at a time, as int64."""
    for start in range(0, count, batch):
        n = min(batch, count - start)
        rows = tokens[start * length : (start + n) * length].astype(np.int64).reshape(n, length)
        yield torch.from_numpy(rows)


WINDOW_TOKENS = 16384
"""Tokens per forward pass of the long-context statistics (batch = this // length, at least 1)."""


def runs_at(model: GPT, length: int) -> bool:
    """Whether `model`'s positions reach `length` (only learned positions stop)."""
    limit = model.pe.max_positions
    return limit is None or length <= limit


def long_context_stats(
    models: list[tuple[str, str, GPT]],
    texts: list[np.ndarray],
    lengths: list[int],
    tokens: int,
    sink_tokens: int,
    progress: bool,
) -> list[dict[str, Any]]:
    """The statistics of every (label, checkpoint path, model) at every length it can run, on the
    first max(1, tokens // length) non-overlapping windows of its text:
    [{"length", "label", "ckpt", "train_length", "summary"}]."""
    plan = [
        (label, path, model, text, length, min(max(1, tokens // length), len(text) // length))
        for length in lengths
        for (label, path, model), text in zip(models, texts, strict=True)
        if runs_at(model, length)
    ]
    entries = []
    bar_on = progress and sys.stderr.isatty()  # a bar in a log file is a carriage-return flood
    with tqdm(total=sum(p[-1] for p in plan), unit="window", disable=not bar_on, dynamic_ncols=True) as bar:
        for label, path, model, text, length, count in plan:
            bar.set_description(f"attention {label} L={length}")
            device = model.wte.weight.device
            stats = AttentionStats(model.config.n_layer, model.config.n_head, length, sink_tokens, device)
            for batch in windows_of(text, length, count, max(1, WINDOW_TOKENS // length)):
                stats.add_windows(model, batch.to(device))
                bar.update(batch.size(0))
            entries.append({"length": length, "label": label, "ckpt": path, "train_length": model.config.block_size,
                            "summary": stats.summary()})  # fmt: skip
    return entries


def prompt_weights(model: GPT, idx: Tensor) -> list[Tensor]:
    """Every layer's weights (H, T, T) for one short prompt `idx` (1, T): for heatmaps only (the
    whole matrices are kept)."""
    chunks: list[list[Tensor]] = [[] for _ in model.blocks]

    def visit(layer: int) -> WeightsHook:
        return lambda rows, weights: chunks[layer].append(weights[0].cpu())

    model.attention_weights(idx, visit)
    return [torch.cat(c, dim=1) for c in chunks]


def visible_keys(model: GPT, length: int) -> Tensor:
    """(T, T) bool: which keys each query may attend to (the model's mask; linear attention is causal)."""
    pos = torch.arange(length)
    return model.mask.dense(pos, pos)
