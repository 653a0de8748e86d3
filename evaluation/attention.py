"""Where attention goes: the weights of every layer and head, recomputed on the reference path, and
the statistics of them that explain what a position scheme does past its training length.

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
- **sink rate** per layer and for the model (Gu et al., ICLR 2025, "When Attention Sink Emerges in
  Language Models"): for each window, layer and head, alpha_0 = the weight on the first token
  averaged over the window's T queries; the sink rate is the share of (window, head) pairs of a
  layer (of the model: of every layer) with alpha_0 > 0.3. Beside it, each head's
  `first_token_mass`, alpha_0 averaged over windows.

The sink rate follows the authors' code: `compute_attention_sink` in eval_sink_open_source.py of
github.com/sail-sg/Attention-Sink (commit e0d3b0e477bad52b620d0d9e063ac2497fed727f, unchanged at
HEAD af49727230ee57b6ecadcc74547653fc776833fc; pretrain/eval_sink_pretrain.py computes the same).
There the weights of every sample form a (samples, layers, heads, T, T) array; key j's importance is
the sum over all T query rows of weight (i, j) divided by T - j, the number of queries at or after j
whatever the mask. For the first token that is the plain mean over all T queries, query 0 included
(whose weight on it is 1). Each sample's importance is compared with epsilon = 0.3 by a strict `>`,
and the 0/1 indicators are averaged over samples, layers and heads at once (reported x 100). A
window here is one of their samples. Thresholding each window before averaging is what makes it
their metric: the mean of alpha_0 over windows thresholded once (this project's number before
issue 33) says 1/8 for one head of eight with alpha_0 = 0.5 and 0.2 in two windows, theirs 1/16.
Their divisor ignores the mask (their window-attention models are measured with it too): under a
sliding window without sinks the queries that cannot see the first token count, with weight 0.

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
"""Gu et al.'s epsilon: a head whose first-token weight alpha_0 in a window exceeds it (strictly) is a
sink in that window."""
SINK_RATE_DEFINITION = "per-window alpha_0 > threshold (Gu et al. 2025)"
"""Marks a summary's `sink_rate` as Gu et al.'s metric: summaries written before issue 33 lack it, and
theirs thresholded alpha_0 averaged over windows (a report must not show those as the sink rate)."""
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
    query position, each summed over windows; alpha_0 summed over windows and the windows in which it
    passed the threshold (the sink rate)."""

    distance: Tensor
    entropy: Tensor
    sink: Tensor
    first_mass: Tensor
    """(H,): alpha_0 (first-token weight averaged over a window's queries), summed over windows."""
    sink_windows: Tensor
    """(H,): windows in which the head's alpha_0 exceeded the threshold."""
    pending: Tensor | None = None
    """(B, H): first-token weight summed over the query rows of the batch seen so far (the chunks of a
    batch arrive a few rows at a time; alpha_0 is known once all `length` rows have come)."""
    pending_rows: int = 0


class AttentionStats:
    """Accumulates the statistics of every layer over windows of one length; `hook(layer)` is the
    `visit` of `GPT.attention_weights`. Memory: a few (H, length) sums per layer, and (B, H) for the
    batch in progress."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        length: int,
        sink_tokens: int,
        device: torch.device,
        threshold: float = SINK_RATE_THRESHOLD,
    ) -> None:
        self.length, self.sink_tokens, self.windows, self.threshold = length, sink_tokens, 0, threshold

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        self.layers = [
            LayerSums(zeros(n_head, length), zeros(n_head, length), zeros(n_head, length), zeros(n_head), zeros(n_head))
            for _ in range(n_layer)
        ]

    def hook(self, layer: int) -> WeightsHook:
        def add(rows: slice, weights: Tensor) -> None:
            sums = self.layers[layer]
            sums.distance += distance_sums(weights, rows).double()
            sums.entropy[:, rows] += row_entropy(weights).sum(0).double()
            sums.sink[:, rows] += weights[..., : self.sink_tokens].sum(-1).sum(0).double()
            first = weights[..., 0].double().sum(-1)  # (B, H): these rows' weight on the first key
            sums.pending = first if sums.pending is None else sums.pending + first
            sums.pending_rows += rows.stop - rows.start
            if sums.pending_rows == self.length:  # every query of these windows seen: alpha_0 is known
                alpha0 = sums.pending / self.length  # (B, H), the mean over all T queries (Gu et al.)
                sums.first_mass += alpha0.sum(0)
                sums.sink_windows += (alpha0 > self.threshold).sum(0)
                sums.pending, sums.pending_rows = None, 0

        return add

    def add_windows(self, model: GPT, windows: Tensor) -> None:
        """Run `windows` (B, length) token ids through `model`, adding their attention to the sums."""
        model.attention_weights(windows, self.hook)
        self.windows += windows.size(0)

    def summary(self) -> dict[str, Any]:
        """Per layer and head, bucketed (log-spaced) means over windows and queries:
        {"distance": {"edges", "mean_weight"}, "position": {"edges", "entropy", "sink_mass"}} where
        mean_weight / entropy / sink_mass are [layer][head][bucket]; and "sink_rate" (`sink_rate`)."""
        n = self.length
        edges = log_edges(n)
        queries_at = (n - np.arange(n)) * self.windows  # queries that have a key d back, over windows
        distance = np.stack([s.distance.cpu().numpy() for s in self.layers]) / queries_at
        entropy = np.stack([s.entropy.cpu().numpy() for s in self.layers]) / self.windows
        sink = np.stack([s.sink.cpu().numpy() for s in self.layers]) / self.windows
        if any(s.pending_rows for s in self.layers):
            raise RuntimeError("A batch of windows was summarised before all its query rows had been added.")
        first = np.stack([s.first_mass.cpu().numpy() for s in self.layers]) / self.windows  # (layers, heads)
        sinks = np.stack([s.sink_windows.cpu().numpy() for s in self.layers]) / self.windows  # (layers, heads)
        return {
            "windows": self.windows,
            "sink_tokens": self.sink_tokens,
            "sink_rate": sink_rate(sinks, first, self.threshold),
            "distance": {"edges": edges, "mean_weight": _rounded(bucket_means(distance, edges))},
            "position": {
                "edges": edges,
                "entropy": _rounded(bucket_means(entropy, edges)),
                "sink_mass": _rounded(bucket_means(sink, edges)),
            },
        }


def sink_rate(sink_share: np.ndarray, first_mass: np.ndarray, threshold: float) -> dict[str, Any]:
    """Gu et al.'s sink rate from, per layer and head (layers, heads), the share of windows in which
    alpha_0 > `threshold` (`per_head`) and alpha_0's mean over windows (`first_token_mass`, for
    reading only: the rate never thresholds it). `per_layer` and `model` average the per-window
    indicators over windows and heads (and layers): every head sees the same windows."""
    return {"definition": SINK_RATE_DEFINITION, "threshold": threshold, "per_layer": _rounded(sink_share.mean(-1)),
            "model": float(f"{sink_share.mean():.6g}"), "per_head": _rounded(sink_share),
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
