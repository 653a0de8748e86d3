"""A run's training curves (loss against steps and tokens, learning rate), drawn from its CSV metrics or
TensorBoard events into `<run dir>/training.png` at the end of training and by `posgpt plot`. A plain
`Figure`, no pyplot: drawing touches no global state and picks no backend."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from posgpt.core.cli import Command
from posgpt.core.errors import UserError
from posgpt.core.files import atomic_file
from posgpt.core.units import format_count

PLOT_FILE = "training.png"
METRICS_FILE = "metrics.csv"  # a file, and a directory, for all the launches (training.logs writes them)
TENSORBOARD_DIR = "tensorboard"
SERIES = ("train/loss", "val/loss", "lr", "train/tokens")  # the logged columns the plot reads

Metrics = dict[str, list[tuple[int, float]]]  # {column: [(optimizer step, value), ...] in step order}


def metric_files(run_dir: Path) -> list[Path]:
    """The run's metrics files, oldest launch first: the `logs/version_N/` files of older runs (by N: the shorter
    name first), then the run's one."""
    versions = sorted((run_dir / "logs").glob("version_*/metrics.csv"), key=lambda p: (len(str(p)), str(p)))
    single = run_dir / METRICS_FILE
    return versions + ([single] if single.is_file() else [])


def read_launch(path: Path) -> dict[int, dict[str, float]]:
    """{step: {column: value}} of one metrics file, a step's rows merged; a cell that is no number (the half-written
    last line of a killed launch) is left out."""
    rows: dict[int, dict[str, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if (step := cell_number(row.get("step"))) is not None:
                values = {name: value for name in SERIES if (value := cell_number(row.get(name))) is not None}
                rows.setdefault(int(step) + 1, {}).update(values)  # Lightning logs step k at index k - 1
    return rows


def cell_number(cell: str | None) -> float | None:
    try:
        return float(cell) if cell else None
    except ValueError:
        return None


def read_metrics(run_dir: Path) -> Metrics:
    """The run's logged metrics as one series per column: its CSV metrics, else its TensorBoard events."""
    if files := metric_files(run_dir):  # oldest launch first: a resumed launch replaces the rows from its first step on
        merged: dict[int, dict[str, float]] = {}
        for rows in filter(None, map(read_launch, files)):
            first = min(rows)
            merged = {step: values for step, values in merged.items() if step < first}
            merged.update(rows)
        return {name: [(s, merged[s][name]) for s in sorted(merged) if name in merged[s]] for name in SERIES}
    directory = run_dir / TENSORBOARD_DIR  # a resume purges the steps it trains again from the events
    if not directory.is_dir():
        raise UserError(
            f"{run_dir} holds neither a metrics.csv nor TensorBoard events: plots are drawn from the metrics of "
            "--train.logger csv (the default) or tensorboard (wandb draws its own)."
        )
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise UserError(f"Reading the TensorBoard events in {directory} needs the tensorboard package: "
                        "pip install tensorboard.") from None  # fmt: skip
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0}).Reload()
    tags = set(events.Tags()["scalars"])  # steps as the CSV's: Lightning logs step k at index k - 1
    return {name: [(e.step + 1, e.value) for e in events.Scalars(name)] if name in tags else [] for name in SERIES}


def training_figure(metrics: Metrics, title: str) -> Figure:
    """Loss above, learning rate below, against optimizer steps; tokens seen on a second x axis when logged."""
    fig = Figure(figsize=(7, 6), dpi=100, layout="constrained")
    loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    for name, label, style in (("train/loss", "train", {"color": "C0", "lw": 1.0}),
                               ("val/loss", "validation", {"color": "C3", "marker": "o", "ms": 3.5})):  # fmt: skip
        if points := metrics.get(name):
            steps, values = zip(*points, strict=True)
            loss_ax.plot(steps, values, label=f"{label} (last {values[-1]:.3f})", **style)
    loss_ax.set_ylabel("loss (nats)")
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend(fontsize=8)
    loss_ax.set_title(title, fontsize=10)
    tokens = metrics.get("train/tokens") or []
    if tokens and tokens[-1][0] > 0 and tokens[-1][1] > 0:  # tokens per step, from the logged count
        per_step = tokens[-1][1] / tokens[-1][0]
        axis = loss_ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_count(v)))
        axis.set_xlabel("tokens seen", fontsize=8)
        axis.tick_params(labelsize=7)
    if lr := metrics.get("lr"):
        steps, values = zip(*lr, strict=True)
        lr_ax.plot(steps, values, color="C2", lw=1.0)
    lr_ax.set_ylabel("learning rate", fontsize=8)
    lr_ax.set_xlabel("optimizer step")
    lr_ax.grid(True, alpha=0.3)
    lr_ax.tick_params(labelsize=7)
    return fig


def write_training_plot(run_dir: Path) -> Path:
    """Draw the run's curves into `<run dir>/training.png` (written atomically); its path."""
    metrics = read_metrics(run_dir)
    if not any(metrics[name] for name in ("train/loss", "val/loss")):
        raise UserError(f"{run_dir}'s metrics hold no loss yet: train for at least --train.log_interval steps.")
    path = run_dir / PLOT_FILE
    try:
        with atomic_file(path) as f:
            training_figure(metrics, run_dir.resolve().name).savefig(f, format="png")
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror or error}.") from None
    return path


@dataclass
class PlotConfig:
    """Options of `posgpt plot`."""

    run_dir: str
    """A run directory (runs/NAME), whose metrics.csv (or TensorBoard events) is drawn into training.png beside it."""


def main(cfg: PlotConfig) -> None:
    run_dir = Path(cfg.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"--run_dir {run_dir}: no such directory. Pass a run directory such as runs/NAME.")
    print(f"wrote {write_training_plot(run_dir)}")


COMMAND = Command(
    "posgpt plot",
    PlotConfig,
    main,
    "Draw a run's training curves (train and validation loss against steps and tokens, learning rate) into "
    "<run dir>/training.png.",
)

if __name__ == "__main__":  # `python -m` would load this module under a second name, __main__
    raise SystemExit("error: run `posgpt plot` (or `python -m posgpt plot`).")
