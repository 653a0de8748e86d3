"""The figures' common ground (PNG bytes, curve styles, a legend below the panels) and the attention figures:
per-head heatmaps for a short prompt (`posgpt attention`), and mass by distance, entropy and sink mass against
position at long contexts (`posgpt attention`, `posgpt evaluate --eval.attention_stats`; the numbers are
`evaluation.attention_stats`')."""

from __future__ import annotations

import io
import itertools
import math
import textwrap
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import PowerNorm, TwoSlopeNorm  # noqa: E402

from posgpt.evaluation.attention_stats import bucket_means  # noqa: E402

STATS_FIGURES = "attention_L*.png"
"""The attention-statistics figures: an earlier report's in the same directory go."""
SPECIAL = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}
LEGEND_WRAP = 40
"""Characters per line of a legend label; longer labels wrap."""
PANELS = (
    ("distance", "mean_weight", "mean weight at distance", "1 + distance i - j (keys back)"),
    ("position", "entropy", "entropy (nats)", "1 + query position i"),
    ("position", "sink_mass", "mass on the first {sinks} tokens", "1 + query position i"),
)


def line_style(i: int) -> dict[str, str]:
    """The i-th curve's colour and line style: ten colours, solid, dashed, then dotted (30 distinct curves)."""
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":")[(i // 10) % 3]}


def png_bytes(fig: plt.Figure) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def printable(piece: str) -> str:
    """A token's text as an axis label: spaces and line breaks as visible symbols, other control
    characters escaped, an empty piece (part of a multi-byte character) as '·'."""
    return "".join(SPECIAL.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in piece) or "·"


def heatmaps_figure(
    panels: list[tuple[str, torch.Tensor]], visible: torch.Tensor, tokens: list[str], title: str, cols: int
) -> plt.Figure:
    """Query x key heatmaps of (name, (T, T) weights) on one colour scale, keys a query cannot see blank."""
    shown = [(name, matrix.masked_fill(~visible, float("nan"))) for name, matrix in panels]  # unseen keys blank
    values = torch.stack([m for _, m in shown])
    low, high = float(values[values.isfinite()].min()), float(values[values.isfinite()].max())
    # square-root from 0 (faint weights stay visible), or centred on 0 for negative weights (linear + RoPE)
    bound = max(-low, high)
    norm = TwoSlopeNorm(0.0, -bound, bound) if low < 0 else PowerNorm(gamma=0.5, vmin=0.0, vmax=max(high, 1e-9))
    cmap = plt.get_cmap("RdBu_r" if low < 0 else "viridis").with_extremes(bad="white")
    rows, T = math.ceil(len(shown) / cols), len(tokens)
    side, size = 1.0 + 0.12 * T, max(5.0, min(9.0, 450 / T))
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols + 1.2, side * rows + 0.6), dpi=90, squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, (name, matrix) in zip(axes.flat, shown, strict=False):
        image = ax.imshow(matrix.numpy(), norm=norm, cmap=cmap, interpolation="nearest")
        ax.set_xticks(range(T), tokens, rotation=90, fontsize=size, fontfamily="monospace")
        ax.set_yticks(range(T), tokens, fontsize=size, fontfamily="monospace")
        ax.tick_params(length=0, pad=1)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
        ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title, fontsize=10)
    return fig


def _centres(edges: list[int]) -> np.ndarray:
    """1 + the middle of each bucket [lo, hi): a log axis cannot show distance or position 0."""
    return np.array([(lo + hi - 1) / 2 + 1 for lo, hi in zip(edges[:-1], edges[1:], strict=True)])


def stats_figure(entries: list[dict[str, Any]], length: int) -> plt.Figure:
    """Rows = layers; columns = mass by distance, entropy and sink mass by query position; one colour
    per label (mean over heads and seeds; each head thin for up to two labels). `entries`: every entry
    of the report, so that a label keeps its colour in every figure; those at `length` are drawn."""
    colour = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(e["label"] for e in entries))}
    entries = [e for e in entries if e["length"] == length]
    n_layer = max(len(e["summary"]["distance"]["mean_weight"]) for e in entries)
    labels = list(dict.fromkeys(e["label"] for e in entries))
    sinks = entries[0]["summary"]["sink_tokens"]
    fig, axes = plt.subplots(n_layer, 3, figsize=(12, 2.4 * n_layer + 0.9), dpi=72, squeeze=False,
                             layout="constrained")  # fmt: skip
    for col, (key, field, ylabel, xlabel) in enumerate(PANELS):
        for label in labels:
            seeds = [e for e in entries if e["label"] == label]
            values = np.mean([np.array(e["summary"][key][field]) for e in seeds], axis=0)  # [layer][head][bucket]
            train_length, x = seeds[0]["train_length"], _centres(seeds[0]["summary"][key]["edges"])
            for layer, per_head in enumerate(values):
                ax = axes[layer, col]
                if len(labels) <= 2:
                    for head in per_head:
                        ax.plot(x, head, color=colour[label], lw=0.6, alpha=0.35)
                ax.plot(x, per_head.mean(0), color=colour[label], lw=1.8, label=label)
                if train_length < length:
                    ax.axvline(train_length + (1 if key == "position" else 0), color=colour[label], ls="--", lw=0.8)
        for layer in range(n_layer):
            ax = axes[layer, col]
            ax.set(xscale="log", yscale="log" if key == "distance" else "linear")
            if key == "position":  # what uniform attention over the i + 1 visible keys gives, for reference
                edges = entries[0]["summary"]["position"]["edges"]
                i = np.arange(length) + 1.0
                uniform = np.log(i) if field == "entropy" else np.minimum(1.0, sinks / i)
                ax.plot(_centres(edges), bucket_means(uniform, edges), color="0.5", ls=":", lw=1,
                        label="uniform over i + 1 keys" if layer == 0 else None)  # fmt: skip
            kinds = {e["kinds"][layer] for e in entries if len(e.get("kinds", ())) > layer}  # a layout's, if one
            kind = f" ({', '.join(sorted(kinds))})" if kinds else ""
            ax.set_ylabel(f"layer {layer}{kind}\n" + ylabel.format(sinks=sinks), fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", alpha=0.3)
        axes[-1, col].set_xlabel(xlabel, fontsize=8)
    legend_below(fig, *axes[0, 1].get_legend_handles_labels())
    fig.suptitle(f"Where attention goes at L = {length} (dashed: training length)", fontsize=10)
    return fig


def legend_below(fig: plt.Figure, handles: Sequence[Any], labels: Sequence[str], max_cols: int = 6) -> None:
    """A legend under the panels of constrained-layout `fig`, inside it: as many columns as fit, labels
    wrapped where one column is too wide, the figure widened where that still does not fit, and taller
    by the legend's height so the panels keep theirs."""
    if not handles:
        return
    renderer = fig.canvas.get_renderer()
    wrapped = [textwrap.fill(label, LEGEND_WRAP) for label in labels]
    for names, ncol in itertools.product((list(labels), wrapped), range(min(len(labels), max_cols), 0, -1)):
        legend = fig.legend(handles, names, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)
        if legend.get_window_extent(renderer).width <= 0.96 * fig.bbox.width:
            break
        legend.remove()
    else:  # a label with a word too long for the figure
        legend = fig.legend(handles, wrapped, loc="outside lower center", ncol=1, fontsize=8, frameon=False)
        fig.set_figwidth(legend.get_window_extent(renderer).width / fig.dpi / 0.96)
    fig.set_figheight(fig.get_figheight() + legend.get_window_extent(renderer).height / fig.dpi)


def stats_pngs(entries: list[dict[str, Any]]) -> dict[str, bytes]:
    """{attention_L{length}.png: its figure} for every length of `entries`."""
    return {f"attention_L{n}.png": png_bytes(stats_figure(entries, n)) for n in sorted({e["length"] for e in entries})}


def grid_figure(panels: dict[str, list[list[tuple[float, float] | None]]], columns: list[str], rows: list[str],
                xlabel: str, ylabel: str, title: str) -> plt.Figure:  # fmt: skip
    """Accuracy (%) heatmaps, a panel per model: `panels[label][row][column]` the (mean, sd) of a share in [0, 1],
    None where not applicable (blank); the numbers written in, readable without the colour bar."""
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols + 1, 2.6 * nrows + 0.6), dpi=90, squeeze=False,
                             layout="constrained")  # fmt: skip
    image = None
    for ax, (label, cells) in zip(axes.flat, panels.items(), strict=False):
        grid = np.array([[np.nan if c is None else 100 * c[0] for c in row] for row in cells], dtype=float)
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="upper")
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6, color="k" if value > 60 else "w")
        ax.set_xticks(range(len(columns)), columns, fontsize=7, rotation=45)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.7, label="accuracy (%)")
    fig.suptitle(title, fontsize=10)
    return fig
