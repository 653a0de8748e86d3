"""Where attention goes, as numbers: mass by distance, entropy and sink mass by query position, and the sink rate,
accumulated over windows from the weights `GPT.attention_weights` recomputes in float32 on the eager reference
kernel, a chunk of query rows at a time (no (layers, heads, T, T) tensor). `posgpt attention` and `posgpt
evaluate` compute them; `evaluation.report` and `evaluation.figures` show them (docs/attention_maps.md).

The sink rate follows Gu et al.'s `compute_attention_sink` (github.com/sail-sg/Attention-Sink,
eval_sink_open_source.py at e0d3b0e477bad52b620d0d9e063ac2497fed727f): alpha_0, the first token's weight
averaged over all T queries of a window (its divisor ignores the mask), is thresholded per window with a
strict `>`, then the indicators are averaged. Linear attention with RoPE has signed weights: its entropy
is that of |w| normalised per row.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from posgpt.evaluation.checkpoint import LoadedCheckpoint, progress_bar
from posgpt.model.gpt import GPT
from posgpt.model.kernels import WeightsHook

SINK_RATE_THRESHOLD = 0.3
"""Gu et al.'s epsilon: a head with alpha_0 above it in a window is a sink in that window."""
SINK_RATE_DEFINITION = "per-window alpha_0 > threshold (Gu et al. 2025)"
"""Marks Gu et al.'s metric: summaries from before issue 33 thresholded alpha_0 averaged over windows."""
PER_OCTAVE = 4
"""Buckets per doubling of distance or position in the summaries (the plots are log-x)."""
WINDOW_TOKENS = 16384
"""Tokens per forward pass of the long-context statistics."""


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


class AttentionStats:
    """Accumulates the statistics of every layer over windows of one length; `hook(layer)` is the
    `visit` of `GPT.attention_weights`."""

    def __init__(self, n_layer: int, n_head: int, length: int, sink_tokens: int, device: torch.device) -> None:
        self.length, self.sink_tokens, self.windows = length, sink_tokens, 0
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        # summed over windows, (layers, H, length): weight by distance, entropy and sink mass by query position
        self.distance, self.entropy, self.sink = (zeros(n_layer, n_head, length) for _ in range(3))
        # (layers, H): alpha_0 summed over windows, and the windows in which it passed the threshold
        self.first_mass, self.sink_windows = zeros(n_layer, n_head), zeros(n_layer, n_head)
        # per layer, (B, H): first-token weight over the batch's query rows seen so far (alpha_0 once all have come)
        self.pending: list[Tensor | None] = [None] * n_layer
        self.pending_rows = [0] * n_layer

    def hook(self, layer: int) -> WeightsHook:
        def add(rows: slice, weights: Tensor) -> None:
            """`weights` (B, H, rows, Tk): of the queries at positions `rows`, keys at 0..Tk-1."""
            q_pos = torch.arange(rows.start, rows.stop, device=weights.device)
            distance = q_pos[:, None] - torch.arange(weights.size(-1), device=weights.device)[None, :]  # d = i - j
            w = weights.sum(0).masked_fill(distance < 0, 0.0)  # (H, rows, Tk): keys after the query carry nothing
            sums = w.new_zeros(w.size(0), weights.size(-1))  # (H, Tk): over batch and queries, by distance
            self.distance[layer] += sums.index_add_(1, distance.clamp(min=0).flatten(), w.flatten(1)).double()
            p = weights.abs()  # entropy (nats) of each row: -sum p log p with p = |w| / sum |w|
            p = p / p.sum(-1, keepdim=True)
            self.entropy[layer, :, rows] += (-torch.special.xlogy(p, p).sum(-1)).sum(0).double()
            self.sink[layer, :, rows] += weights[..., : self.sink_tokens].sum(-1).sum(0).double()
            first = weights[..., 0].double().sum(-1)  # (B, H): these rows' weight on the first key
            pending = self.pending[layer]
            self.pending[layer] = first if pending is None else pending + first
            self.pending_rows[layer] += rows.stop - rows.start
            if self.pending_rows[layer] == self.length:  # every query of these windows seen: alpha_0 is known
                alpha0 = self.pending[layer] / self.length  # (B, H), the mean over all T queries (Gu et al.)
                self.first_mass[layer] += alpha0.sum(0)
                self.sink_windows[layer] += (alpha0 > SINK_RATE_THRESHOLD).sum(0)
                self.pending[layer], self.pending_rows[layer] = None, 0

        return add

    def add_windows(self, model: GPT, windows: Tensor) -> None:
        """Run `windows` (B, length) token ids through `model`, adding their attention to the sums."""
        model.attention_weights(windows, self.hook)
        self.windows += windows.size(0)

    def summary(self) -> dict[str, Any]:
        """Per layer and head, bucketed means over windows and queries ([layer][head][bucket]), and the sink rate."""
        n = self.length
        edges = log_edges(n)
        queries_at = (n - np.arange(n)) * self.windows  # queries that have a key d back, over windows
        distance = self.distance.cpu().numpy() / queries_at
        if any(self.pending_rows):
            raise RuntimeError("A batch of windows was summarised before all its query rows had been added.")
        first = self.first_mass.cpu().numpy() / self.windows  # (layers, heads): alpha_0's mean, never thresholded
        sinks = self.sink_windows.cpu().numpy() / self.windows  # (layers, heads): the share of sink windows
        rate = {"definition": SINK_RATE_DEFINITION, "threshold": SINK_RATE_THRESHOLD,
                "per_layer": rounded(sinks.mean(-1)), "model": float(f"{sinks.mean():.6g}"),
                "per_head": rounded(sinks), "first_token_mass": rounded(first)}  # fmt: skip
        return {
            "windows": self.windows,
            "sink_tokens": self.sink_tokens,
            "sink_rate": rate,
            "distance": {"edges": edges, "mean_weight": rounded(bucket_means(distance, edges))},
            "position": {
                "edges": edges,
                "entropy": rounded(bucket_means(self.entropy.cpu().numpy() / self.windows, edges)),
                "sink_mass": rounded(bucket_means(self.sink.cpu().numpy() / self.windows, edges)),
            },
        }


def rounded(values: np.ndarray, digits: int = 6) -> list:
    """`values` as nested lists of floats of `digits` significant digits (results.json stays readable)."""
    return np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[float])(values).tolist()


def runs_at(model: GPT, length: int) -> bool:
    return model.pe.max_positions is None or length <= model.pe.max_positions


def long_context_stats(
    labels: list[str],
    loaded: list[LoadedCheckpoint],
    texts: list[tuple[np.ndarray, dict]],
    lengths: list[int],
    tokens: int,
    sink_tokens: int,
    device: torch.device,
    progress: bool,
) -> list[dict[str, Any]]:
    """The statistics of every checkpoint (its label, its text's tokens and record as `load_texts` gives them) at
    every length its model can run, on `device`, on the first max(1, tokens // length) non-overlapping windows."""
    plan = [
        (label, ckpt, text, length, min(max(1, tokens // length), len(text) // length))
        for length in lengths
        for label, ckpt, (text, _) in zip(labels, loaded, texts, strict=True)
        if runs_at(ckpt.model, length)
    ]
    entries = []
    with progress_bar(sum(p[-1] for p in plan), "window", progress) as bar:
        for label, ckpt, text, length, count in plan:
            bar.set_description(f"attention {label} L={length}")
            model = ckpt.model.to(device).eval()
            stats = AttentionStats(model.config.n_layer, model.config.n_head, length, sink_tokens, device)
            windows = torch.from_numpy(text[: count * length].astype(np.int64)).view(count, length)
            for batch in windows.split(max(1, WINDOW_TOKENS // length)):
                stats.add_windows(model, batch.to(device))
                bar.update(batch.size(0))
            kinds = [kind.name for kind in model.kind_of] if model.config.layout else None  # a layout's, per layer
            entries.append({"length": length, "label": label, "ckpt": ckpt.path,
                            "train_length": model.config.block_size, "summary": stats.summary(),
                            **({"kinds": kinds} if kinds else {})})  # fmt: skip
    return entries
