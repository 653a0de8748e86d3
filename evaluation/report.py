"""Write an evaluation's results: `results.json`, `results.md`, `ppl_vs_length.png`, `loss_by_position.png`
(and `attention_L<length>.png` with the attention statistics, `evaluation.figures`), each file whole. Runs that
share a label are seeds of one model: the table and plots show their mean and standard deviation.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from posgpt.core.files import atomic_write_bytes
from posgpt.evaluation.attention_stats import SINK_RATE_DEFINITION
from posgpt.evaluation.figures import (
    STATS_FIGURES,
    grid_figure,
    legend_below,
    line_style,
    plt,
    png_bytes,
    stats_pngs,
)
from posgpt.model.config import AS_TRAINED, model_tags

MAX_PANELS = 6
"""Lengths shown in loss_by_position.png (evenly chosen, the longest among them)."""
TRAIN_LENGTH_LINE = {"color": "black", "linestyle": "-.", "linewidth": 0.9}
"""The training length's marker: black dash-dots, which no model's curve uses."""


@dataclass
class Group:
    """The runs of one label (one per seed)."""

    label: str
    runs: list[dict[str, Any]]

    def column(self, key: str) -> list[Any]:
        return [run.get(key) for run in self.runs]  # None: a field older results lack

    def rows_at(self, length: int) -> list[dict[str, Any]]:
        return [next(r for r in run["results"] if r["length"] == length) for run in self.runs]

    def ppl_at(self, length: int) -> tuple[float, float] | None:
        return mean_sd([row["ppl"] for row in self.rows_at(length)])


def mean_sd(values: list[float | None]) -> tuple[float, float] | None:
    """Mean and standard deviation over seeds (0 for one seed), None where one is None (not applicable)."""
    if any(v is None for v in values):
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def group_runs(doc: dict[str, Any]) -> list[Group]:
    groups: dict[str, Group] = {}
    for run in doc["runs"]:
        groups.setdefault(run["label"], Group(run["label"], [])).runs.append(run)
    return list(groups.values())


def write_report(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the report's files into `out_dir` (created if needed); returns their paths."""
    groups = group_runs(doc)
    files = {
        "results.md": markdown_table(doc, groups).encode(),
        "ppl_vs_length.png": png_bytes(ppl_figure(doc, groups)),
        "loss_by_position.png": png_bytes(position_figure(doc, groups)),
    }
    files.update(stats_pngs(doc.get("attention", [])))  # with --eval.attention_stats
    files.update(probe_pngs(groups))  # with --eval.probes
    paths = write_files(doc, files, out_dir)
    for stale in {*Path(out_dir).glob(STATS_FIGURES), *Path(out_dir).glob("probe_*.png")} - set(paths):  # earlier
        stale.unlink()
    return paths


def write_files(doc: dict[str, Any], files: dict[str, bytes], out_dir: str | Path) -> list[Path]:
    """results.json of `doc`, then `files`, each written whole into `out_dir` (created if needed); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"results.json": json.dumps(doc, indent=1, allow_nan=False).encode(), **files}
    for name, payload in files.items():
        atomic_write_bytes(out / name, payload)
    return [out / name for name in files]


def fmt(value: float) -> str:
    """A perplexity with about three significant figures, never in e-notation."""
    return f"{value:.2f}" if value < 100 else f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def markdown_table(doc: dict[str, Any], groups: list[Group]) -> str:
    """Rows = models, columns = lengths, cells = perplexity (mean ± std over seeds)."""
    lengths = doc["settings"]["lengths"]
    lines = ["# Perplexity against context length", ""]
    lines += [f"- {line}" for line in _settings_lines(doc, groups)]
    lines += ["", "| model | positions | params | train length | tokenizer | seeds | " + " | ".join(map(str, lengths))
              + " |", "|---|---|---:|---:|---|---:|" + "---:|" * len(lengths)]  # fmt: skip
    for g in groups:
        spread = len(g.runs) > 1
        cells = [fmt(st[0]) + (f" ± {fmt(st[1])}" if spread else "") if (st := g.ppl_at(n)) else "n/a" for n in lengths]
        train, tokenizer = _one_or_list(g.column("train_length")), _one_or_list(g.column("tokenizer"))
        model = g.runs[0].get("config", {}).get("model", {})
        scaling = model.get("rope_scaling", "none")  # trained (fine-tuned) with a scaling: which
        scaled = [] if scaling == "none" else [f"{scaling} x{model['rope_scaling_factor']:g}"]
        pos = ", ".join([g.runs[0]["pos_encoding"], *model_tags(model), *scaled])
        params = _one_or_list([f"{n:,}" if n else "n/a" for n in g.column("params")])
        lines.append(f"| {g.label} | {pos} | {params} | {train} | {tokenizer} | {len(g.runs)} | " + " | ".join(cells)
                     + " |")  # fmt: skip
    lines += key_ppl_table(groups, lengths) + probe_tables(groups)
    lines += sink_rate_table(doc.get("attention", []), lengths)
    return "\n".join(lines) + "\n"


def _cells(values: list[float | None], scale: float = 1.0, digits: int = 1) -> str:
    """mean ± sd over seeds of values, n/a where one is None."""
    if (stat := mean_sd(values)) is None:
        return "n/a"
    return f"{scale * stat[0]:.{digits}f}" + (f" ± {scale * stat[1]:.{digits}f}" if len(values) > 1 else "")


def key_ppl_table(groups: list[Group], lengths: list[int]) -> list[str]:
    """Key-token perplexity (LongPPL, self-evaluated) at each length, where asked."""
    if not any(r.get("key_tokens") is not None for g in groups for run in g.runs for r in run["results"]):
        return []
    lines = ["", "## Key-token perplexity (LongPPL's key tokens, found by each model itself; docs/probes.md)", "",
             "| model | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---:|" * len(lengths)]  # fmt: skip
    for g in groups:
        cells = ["none found" if all(r.get("key_tokens") == 0 for r in g.rows_at(n)) else
                 _cells([r.get("key_ppl") for r in g.rows_at(n)], digits=2) for n in lengths]  # fmt: skip
        lines.append(f"| {g.label} | " + " | ".join(cells) + " |")
    return lines


def probe_rows_of(g: Group, probe: str) -> list[dict[str, Any]]:
    return [row for run in g.runs for row in run.get("probes", []) if row["probe"] == probe]


def probe_at(g: Group, probe: str, length: int, depth: object = ...) -> list[float | None]:
    """Each seed's score of `probe` at `length`, averaged over depths (or at `depth`); None where one is n/a."""
    seeds = [[row["score"] for row in run.get("probes", []) if row["probe"] == probe and row["length"] == length
              and depth in (..., row["depth"])] for run in g.runs]  # fmt: skip
    return [None if not scores or None in scores else statistics.fmean(scores) for scores in seeds]


def probe_names(groups: list[Group]) -> list[str]:
    return list(dict.fromkeys(row["probe"] for g in groups for run in g.runs for row in run.get("probes", [])))


def probe_tables(groups: list[Group]) -> list[str]:
    """Each probe's accuracy (%) per model and length, averaged over depths (mean ± sd over seeds)."""
    lines: list[str] = []
    for probe in probe_names(groups):
        lengths = sorted({row["length"] for g in groups for row in probe_rows_of(g, probe)})
        lines += ["", f"## {probe}: accuracy (%) against length, zero-shot (docs/probes.md)", "",
                  "| model | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---:|" * len(lengths)]  # fmt: skip
        for g in groups:
            lines.append(f"| {g.label} | " + " | ".join(_cells(probe_at(g, probe, n), 100) for n in lengths) + " |")
        reasons = sorted({row["reason"] for g in groups for row in probe_rows_of(g, probe) if row["reason"]})
        lines += [f"- n/a: {reason}" for reason in reasons]
    return lines


def probe_pngs(groups: list[Group]) -> dict[str, bytes]:
    """probe_<name>.png: each probe's accuracy by length and depth, a panel per model."""
    files = {}
    for probe in probe_names(groups):
        rows = [row for g in groups for row in probe_rows_of(g, probe)]
        lengths, depths = sorted({r["length"] for r in rows}), list(dict.fromkeys(r["depth"] for r in rows))
        panels = {g.label: [[mean_sd(probe_at(g, probe, n, d)) for n in lengths] for d in depths] for g in groups}
        labels = ["uniform" if d is None else f"{d:g}" for d in depths]
        fig = grid_figure(panels, [str(n) for n in lengths], labels, "length (tokens)", "depth",
                          f"{probe}: accuracy by length and depth")  # fmt: skip
        files[f"probe_{probe}.png"] = png_bytes(fig)
    return files


def sink_rate_table(entries: list[dict[str, Any]], lengths: list[int]) -> list[str]:
    """Each model's sink rate (Gu et al. 2025) at each length, seeds averaged. Statistics from before issue 33
    (another number: alpha_0 averaged over windows, then thresholded) get a table of their own."""
    tables: dict[bool, dict[str, dict[int, list[float]]]] = {True: {}, False: {}}
    threshold: dict[bool, float] = {}
    for entry in entries:
        if (rate := entry["summary"].get("sink_rate")) is not None:
            gu = rate.get("definition") == SINK_RATE_DEFINITION
            threshold[gu] = rate["threshold"]
            tables[gu].setdefault(entry["label"], {}).setdefault(entry["length"], []).append(rate["model"])
    titles = {
        True: "## Sink rate (Gu et al. 2025): share of (window, layer, head) whose first-token weight, "
        "averaged over the window's queries, is > {}",
        False: "## Not the sink rate: share of heads whose first-token weight averaged over all windows is > {} "
        "(statistics from before issue 33; evaluate again for Gu et al.'s sink rate)",
    }
    lines: list[str] = []
    for gu in sorted(threshold, reverse=True):  # the definitions found, Gu et al.'s first
        lines += ["", titles[gu].format(threshold[gu]), ""]
        lines += ["| model | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---:|" * len(lengths)]
        for label, by_length in tables[gu].items():
            cells = [f"{sum(v) / len(v):.2f}" if (v := by_length.get(n)) else "n/a" for n in lengths]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _settings_lines(doc: dict[str, Any], groups: list[Group]) -> list[str]:
    s = doc["settings"]
    if s["mode"] == "sliding":
        mode = f"sliding windows, stride {s['stride']}: only the last {s['stride']} tokens of each window scored"
    else:
        mode = "non-overlapping windows: every token scored, so position i of a window sees i tokens of context"
    lines = [f"mode: {mode}", scored_line(doc)]
    sources = {(run["data"]["source"], run["data"]["tokens"], run["data"]["sha256"][:12]) for run in doc["runs"]}
    lines += [f"text: {source}, {tokens:,} tokens (sha256 {digest})" for source, tokens, digest in sorted(sources)]
    tokenizers = sorted({run["tokenizer"] for run in doc["runs"]})
    if len(tokenizers) > 1:
        lines.append(
            f"tokenizers differ ({', '.join(tokenizers)}): each checkpoint tokenized the text with its own, so a "
            "length counts its own tokens and a perplexity is per token of its own; compare curves, not values "
            "across tokenizers"
        )
    if any(run["rope_scaling"] not in (None, AS_TRAINED) for run in doc["runs"]):
        factor = s["rope_scaling_factor"]
        how = f"{factor}" if factor != "dynamic" else "L / the original length (`original_block_size`) past it"
        lines.append(f"RoPE scaling factor ('+ linear / ntk / yarn' rows): {how}")
    if any(row["reason"] for run in doc["runs"] for row in run["results"]):
        lines.append("n/a: the scheme cannot run at that length (learned positions exist up to block_size)")
    if any(len(g.runs) > 1 for g in groups):
        lines.append("several seeds: mean ± standard deviation across seeds")
    lines.append(f"{doc['device']}, {doc['dtype']}, torch {doc['torch']}, git {doc['git']}, {doc['created']}")
    return lines + study_lines(doc)


def scored_line(doc: dict[str, Any]) -> str:
    """The tokens each length actually scored, not the budget (a shorter text scores fewer); lengths that
    scored the same share a clause, checkpoints with their own tokenizers give a range."""
    budget = doc["settings"]["token_budget"]
    counts: dict[int, list[int]] = {}
    short: set[int] = set()  # lengths with fewer windows than the budget allows: the text ended first
    for row in (row for run in doc["runs"] for row in run["results"] if row["applicable"]):
        counts.setdefault(row["length"], []).append(row["scored_tokens"])
        if row["scored_tokens"] < max(1, budget // row["stride"]) * row["stride"]:
            short.add(row["length"])
    clauses: dict[str, list[str]] = {}
    for length, scored in sorted(counts.items()):
        low, high = min(scored), max(scored)
        clauses.setdefault(f"{low:,}" if low == high else f"{low:,}-{high:,}", []).append(str(length))
    said = "; ".join(f"{n} at {', '.join(lengths)}" for n, lengths in clauses.items())
    if len(clauses) == 1:
        said = f"{next(iter(clauses))} at every length"
    ended = ": the text ended first" if short else ""
    if short and len(short) < len(counts):
        ended += " at " + ", ".join(map(str, sorted(short)))
    return f"tokens scored, from the start of the text: {said} (budget {budget:,}{ended})"


def study_lines(doc: dict[str, Any]) -> list[str]:
    """What a study's report says of its training (`doc["experiment"]`): corpus, tokens, steps and time."""
    study = doc.get("experiment")
    if not study or not study.get("runs"):
        return []
    runs = study["runs"]
    lines = []
    for corpus in sorted({run["data"]["corpus"] or "?" for run in runs}):
        of = [run for run in runs if (run["data"]["corpus"] or "?") == corpus]
        size = of[0]["data"].get("train_tokens")
        lines.append(f"trained on {corpus}" + (f" ({size:,} training tokens)" if size else "") + f": {len(of)} run(s)")
    steps, tokens = {run["steps"] for run in runs}, {run["tokens"] for run in runs}
    lines.append(f"each run: {_one_or_list(sorted(steps))} steps, {_one_or_list(sorted(tokens))} tokens")
    if seconds := [run["train_seconds"] for run in runs if run.get("train_seconds") is not None]:
        lines.append(f"training wall time: {sum(seconds):,.0f} s over {len(seconds)} run(s) (all launches); "
                     f"evaluation {study['eval_wall_s']:,.0f} s")  # fmt: skip
    return lines


def _one_or_list(values: list[Any]) -> str:
    return ", ".join(map(str, dict.fromkeys(values)))  # each value once


def ppl_figure(doc: dict[str, Any], groups: list[Group]) -> plt.Figure:
    """Perplexity against length, log-log, one line per model, the training length(s) marked."""
    lengths = doc["settings"]["lengths"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100, layout="constrained")
    for i, g in enumerate(groups):
        points = [(n, stat) for n in lengths if (stat := g.ppl_at(n)) is not None]
        if not points:
            continue
        ax.errorbar([n for n, _ in points], [m for _, (m, _) in points], yerr=[sd for _, (_, sd) in points],
                    marker="o", ms=3.5, capsize=2, label=g.label, **line_style(i))  # fmt: skip
    _mark_train_lengths(ax, groups)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths], fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    low, high = ax.get_ylim()
    if low > 0 and high / low > 4:  # a scheme that breaks down spans decades: log scale, plain labels
        ax.set_yscale("log")
        ticks = [m * 10.0**e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
                 for m in (1, 1.5, 2, 3, 5, 7)]  # fmt: skip
        ax.yaxis.set_major_locator(FixedLocator([t for t in ticks if low <= t <= high]))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylim(low, high)
    ax.set_xlabel("evaluation context length (tokens)")
    ax.set_ylabel("perplexity")
    mode = doc["settings"]["mode"] + (f", stride {doc['settings']['stride']}" if doc["settings"]["stride"] else "")
    ax.set_title(f"Perplexity against context length ({mode})", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    legend_below(fig, *ax.get_legend_handles_labels())  # below the axes: a study's many curves stay visible
    return fig


def position_figure(doc: dict[str, Any], groups: list[Group]) -> plt.Figure:
    """Loss by position inside the window, one panel per length, one line per model."""
    shown = lengths = doc["settings"]["lengths"]
    if len(lengths) > MAX_PANELS:
        picks = {round(i * (len(lengths) - 1) / (MAX_PANELS - 1)) for i in range(MAX_PANELS)}
        shown = [lengths[i] for i in sorted(picks)]
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows + 0.6), dpi=72, squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, length in zip(axes.flat, shown, strict=False):
        for i, g in enumerate(groups):
            found = g.rows_at(length)
            if not all(r["applicable"] for r in found):
                continue
            starts = found[0]["bucket_starts"]
            mids = [(a + b) / 2 for a, b in zip(starts, starts[1:] + [length], strict=True)]
            curve = [statistics.fmean(col) for col in zip(*(r["by_position"] for r in found), strict=True)]
            ax.plot(mids, curve, marker=".", ms=3, label=g.label, **line_style(i))
        _mark_train_lengths(ax, groups, below=length)
        ax.set_title(f"L = {length}", fontsize=9)
        ax.set_xlim(0, length)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("position in window", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("loss (nats)", fontsize=8)
    # the first panel with curves: the first may have no applicable model
    legend_below(fig, *next((a.get_legend_handles_labels() for a in axes.flat if a.lines), ([], [])))
    fig.suptitle("Loss by position inside the window", fontsize=10)
    return fig


def _mark_train_lengths(ax: plt.Axes, groups: list[Group], below: float = math.inf) -> None:
    for n in sorted({t for g in groups for t in g.column("train_length")}):
        if n < below:
            ax.axvline(n, **TRAIN_LENGTH_LINE)
            ax.annotate(f"trained at {n}", (n, 1), xycoords=("data", "axes fraction"), xytext=(3, -10),
                        textcoords="offset points", fontsize=7, color=TRAIN_LENGTH_LINE["color"])  # fmt: skip
