"""The training curves of a run: train and validation loss against steps and tokens, and the learning
rate, drawn from the run's CSV metrics into `<run dir>/training.png` (at the end of training, and on
demand: `posgpt plot --run_dir runs/NAME` or `python -m evaluation.curves --run_dir runs/NAME`).

A run logs one `metrics.csv` across its launches; a run logged before that has one
`logs/version_N/metrics.csv` per launch, read in order, a later launch's row for a step replacing the
earlier one (a resumed launch repeats the steps after its checkpoint).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from core.cli import Command, run  # noqa: E402
from core.errors import UserError  # noqa: E402
from core.files import atomic_write_bytes  # noqa: E402
from core.units import format_count  # noqa: E402
from evaluation.report import png_bytes  # noqa: E402

PLOT_FILE = "training.png"
SERIES = ("train/loss", "val/loss", "lr", "train/tokens")
"""The logged columns the plot reads (step is every row's)."""


def metric_files(run_dir: Path) -> list[Path]:
    """The run's metrics files, oldest launch first."""
    single = run_dir / "metrics.csv"
    if single.is_file():
        return [single]
    versions = sorted((run_dir / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    return versions


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{column: [(step, value), ...] by step} of the run's logged metrics, each step once (the latest
    launch's value)."""
    files = metric_files(run_dir)
    if not files:
        raise UserError(
            f"{run_dir} holds no metrics.csv: plots are drawn from the csv logger's metrics (train with "
            "--train.logger csv, the default; TensorBoard and wandb draw their own)."
        )
    merged: dict[str, dict[int, float]] = {name: {} for name in SERIES}
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if not row.get("step"):
                    continue
                step = int(float(row["step"])) + 1  # Lightning logs a step's metrics at its 0-based index
                for name in SERIES:
                    if row.get(name):
                        merged[name][step] = float(row[name])
    return {name: sorted(values.items()) for name, values in merged.items()}


def training_figure(metrics: dict[str, list[tuple[int, float]]], title: str) -> plt.Figure:
    """Loss (train and validation) and learning rate against optimizer steps, tokens on a second axis."""
    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(7, 6), dpi=100, sharex=True, height_ratios=(3, 1))
    for name, label, style in (("train/loss", "train", {"color": "C0", "lw": 1.0}),
                               ("val/loss", "validation", {"color": "C3", "marker": "o", "ms": 3.5})):  # fmt: skip
        points = metrics.get(name) or []
        if points:
            steps, values = zip(*points, strict=True)
            loss_ax.plot(steps, values, label=label, **style)
    loss_ax.set_ylabel("loss (nats)")
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend(fontsize=8)
    loss_ax.set_title(title, fontsize=10)
    tokens = metrics.get("train/tokens") or []
    if tokens and tokens[-1][0] > 0:  # tokens per step, from the logged count: a second x axis
        per_step = tokens[-1][1] / tokens[-1][0]
        axis = loss_ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_count(v)))
        axis.set_xlabel("tokens", fontsize=8)
        axis.tick_params(labelsize=7)
    lr = metrics.get("lr") or []
    if lr:
        steps, values = zip(*lr, strict=True)
        lr_ax.plot(steps, values, color="C2", lw=1.0)
    lr_ax.set_ylabel("learning rate", fontsize=8)
    lr_ax.set_xlabel("optimizer step")
    lr_ax.grid(True, alpha=0.3)
    lr_ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def write_training_plot(run_dir: Path) -> Path:
    """Draw the run's curves into `<run dir>/training.png` (written atomically); its path."""
    metrics = read_metrics(run_dir)
    if not any(metrics[name] for name in ("train/loss", "val/loss")):
        raise UserError(f"{run_dir}'s metrics hold no loss yet: train for at least --train.log_interval steps.")
    path = run_dir / PLOT_FILE
    atomic_write_bytes(path, png_bytes(training_figure(metrics, run_dir.name)))
    return path


@dataclass
class PlotConfig:
    """Options of `posgpt plot`."""

    run_dir: str
    """A run directory (runs/NAME), whose metrics.csv is drawn into training.png beside it."""


def main(cfg: PlotConfig) -> None:
    run_dir = Path(cfg.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"--run_dir {run_dir}: no such directory. Pass a run directory such as runs/NAME.")
    print(f"wrote {write_training_plot(run_dir)}")


COMMAND = Command(
    "python -m evaluation.curves",
    PlotConfig,
    main,
    "Draw a run's training curves (train and validation loss against steps and tokens, learning rate) into "
    "<run dir>/training.png.",
)

if __name__ == "__main__":
    run(COMMAND)
