"""The report of a synthetic-task experiment: `results.json`, `results.md` (accuracy, mean ± std over seeds,
by model and test length), `accuracy_vs_length.png`, and for a task with depths `<task>_depth.png`."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from posgpt.data.tasks import TASKS
from posgpt.evaluation.figures import grid_figure, line_style, plt, png_bytes
from posgpt.evaluation.report import group_runs, mean_sd, study_lines, write_files
from posgpt.model.config import model_tags


def length_accuracy(run: dict[str, Any], length: int, key: str = "accuracy") -> float | None:
    """A run's accuracy (or `token_accuracy`) at `length`, averaged over depths; None where not applicable."""
    rows = [r for r in run["results"] if r["length"] == length]
    return statistics.fmean(r[key] for r in rows) if all(r["applicable"] for r in rows) else None


def _cell(values: list[float | None]) -> str:
    if (stat := mean_sd(values)) is None:
        return "n/a"
    return f"{100 * stat[0]:.1f}" + (f" ± {100 * stat[1]:.1f}" if len(values) > 1 else "")


def markdown_table(doc: dict[str, Any]) -> str:
    task, lengths = doc["task"], doc["task"]["eval_lengths"]
    lines = [f"# {task['name']}: exact-match accuracy (%) against length", ""]
    kind = TASKS[task["name"]]
    per = f" and {kind.depth_label} (cells: mean over them)" if kind.depths else ""
    lines.append(f"- trained on lengths {task['train_min']}-{task['train_max']}; {task['test_size']} test "
                 f"examples per length{per}")  # fmt: skip
    lines.append("- greedy decoding with the KV cache; n/a: learned positions cannot reach that length")
    lines.append("- several seeds: mean ± standard deviation across seeds")
    lines.append(f"- {doc['device']}, torch {doc['torch']}, git {doc['git']}, {doc['created']}")
    lines += [f"- {line}" for line in study_lines(doc)]
    for key, title in (("accuracy", "Exact match (%)"), ("token_accuracy", "Answer tokens right (%), partial credit")):
        lines += ["", f"## {title}", "", "| model | positions | seeds | " + " | ".join(map(str, lengths)) + " |"]
        lines.append("|---|---|---:|" + "---:|" * len(lengths))
        for g in group_runs(doc):
            cells = [_cell([length_accuracy(r, n, key) for r in g.runs]) for n in lengths]
            pos = ", ".join([g.runs[0]["pos_encoding"], *model_tags(g.runs[0].get("model", {}))])
            lines.append(f"| {g.label} | {pos} | {len(g.runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def accuracy_figure(doc: dict[str, Any]) -> plt.Figure:
    """Accuracy against length, one line per model with its spread over seeds, the training range shaded."""
    task, lengths = doc["task"], doc["task"]["eval_lengths"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.axvspan(task["train_min"], task["train_max"], color="0.9", label="training lengths")
    for i, g in enumerate(group_runs(doc)):
        points = [(n, stat) for n in lengths if (stat := mean_sd([length_accuracy(r, n) for r in g.runs])) is not None]
        if points:
            ax.errorbar([n for n, _ in points], [100 * m for _, (m, _) in points],
                        yerr=[100 * sd for _, (_, sd) in points], marker="o", ms=3.5, capsize=2, label=g.label,
                        **line_style(i))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths], fontsize=8)
    ax.minorticks_off()
    ax.set_ylim(-3, 103)
    ax.set_xlabel(f"test length ({TASKS[task['name']].unit})")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title(f"{task['name']}: train short, test long", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def depth_figure(doc: dict[str, Any]) -> plt.Figure:
    """Accuracy by length x depth of a task with depths (passkey, flip-flop, selective copy): a panel per model."""
    task = doc["task"]
    lengths, depths, kind = task["eval_lengths"], task["depths"], TASKS[task["name"]]
    panels = {}
    for g in group_runs(doc):
        results = [r for run in g.runs for r in run["results"]]
        panels[g.label] = [[mean_sd([r["accuracy"] for r in results if r["length"] == n and r["depth"] == d] or [None])
                            for n in lengths] for d in depths]  # fmt: skip
    return grid_figure(panels, [str(n) for n in lengths], [f"{d:g}" for d in depths], f"length ({kind.unit})",
                       kind.depth_label, f"{task['name']}: accuracy by length and {kind.depth_label}")  # fmt: skip


def write_task_report(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    files = {"results.md": markdown_table(doc).encode(), "accuracy_vs_length.png": png_bytes(accuracy_figure(doc))}
    if TASKS[doc["task"]["name"]].depths:
        files[f"{doc['task']['name']}_depth.png"] = png_bytes(depth_figure(doc))
    return write_files(doc, files, out_dir)
