"""Figures people look at: a run's training curves (one series across launches), and the perplexity
figure's legend (the loss-by-position figure's legend and training-length marker: test_evaluate.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from posgpt.core import cli
from posgpt.core.errors import UserError
from posgpt.evaluation.report import Group
from posgpt.training import curves

HEADER = "epoch,lr,step,train/loss,train/tokens,val/loss\n"


def test_a_runs_metrics_are_one_series_across_launches(tmp_path):
    """Per-launch files of an older run: the resumed launch repeats steps 10 and 12, whose rows replace
    the first launch's (Lightning logs step k at index k - 1)."""
    first = tmp_path / "logs" / "version_0" / "metrics.csv"
    second = tmp_path / "logs" / "version_1" / "metrics.csv"
    tenth = tmp_path / "logs" / "version_10" / "metrics.csv"  # numeric order, not text order
    for path in (first, second, tenth):
        path.parent.mkdir(parents=True)
    first.write_text(HEADER + "0,1e-3,4,3.0,640,\n0,1e-3,9,2.5,1280,\n0,,9,,,2.6\n0,1e-3,11,2.4,1536,\n")
    second.write_text(HEADER + "0,1e-3,11,2.3,1536,\n0,1e-3,14,2.2,1920,\n")
    tenth.write_text(HEADER + "0,5e-4,19,2.0,2560,\n0,,19,,,2.1\n")
    metrics = curves.read_metrics(tmp_path)
    assert metrics["train/loss"] == [(5, 3.0), (10, 2.5), (12, 2.3), (15, 2.2), (20, 2.0)]
    assert metrics["val/loss"] == [(10, 2.6), (20, 2.1)]
    assert metrics["lr"][-1] == (20, 5e-4)

    (tmp_path / "metrics.csv").write_text(HEADER + "0,1e-3,4,3.0,640,\n")  # one file: it alone is read
    assert curves.read_metrics(tmp_path)["train/loss"] == [(5, 3.0)]


def test_the_plot_is_written_into_the_run_dir_and_on_demand(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_text(HEADER + "0,1e-3,4,3.0,640,\n0,1e-3,9,2.5,1280,\n0,,9,,,2.6\n")
    cli.run(curves.COMMAND, ["--run_dir", str(tmp_path)])
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'training.png'}"
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="--train.logger csv"):
        curves.write_training_plot(empty)


def _launch(run_dir: Path, version: int, rows: str) -> None:
    path = run_dir / "logs" / f"version_{version}" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text(HEADER + rows)


def test_a_resumed_launch_replaces_everything_the_abandoned_one_logged_after_its_checkpoint(tmp_path):
    """The first launch logged steps 10..13 and a validation at 12, then died; the second resumed from the
    checkpoint at step 10 with another log interval: its rows from step 12 on are the run's, the first
    launch's validation at 12 (and its train losses at 12 and 13) are not."""
    _launch(tmp_path, 0, "0,1e-3,9,2.5,1280,\n0,1e-3,10,2.45,1408,\n0,1e-3,11,2.4,1536,\n0,,11,,,2.42\n"
                         "0,1e-3,12,2.38,1664,\n")  # fmt: skip
    _launch(tmp_path, 1, "0,1e-3,11,2.41,1536,\n0,1e-3,13,2.3,1792,\n0,,14,,,2.35\n")
    metrics = curves.read_metrics(tmp_path)
    assert metrics["train/loss"] == [(10, 2.5), (11, 2.45), (12, 2.41), (14, 2.3)]
    assert metrics["val/loss"] == [(15, 2.35)]
    assert metrics["train/tokens"] == [(10, 1280), (11, 1408), (12, 1536), (14, 1792)]


def test_a_run_that_changed_to_one_metrics_file_keeps_its_earlier_launches(tmp_path):
    """Launches logged per version before the upgrade, the resumed launch after it into metrics.csv."""
    _launch(tmp_path, 0, "0,1e-3,4,3.0,640,\n0,1e-3,9,2.5,1280,\n0,1e-3,14,2.2,1920,\n")
    (tmp_path / "metrics.csv").write_text(HEADER + "0,1e-3,14,2.25,1920,\n0,1e-3,19,2.0,2560,\n")
    assert curves.read_metrics(tmp_path)["train/loss"] == [(5, 3.0), (10, 2.5), (15, 2.25), (20, 2.0)]


def test_the_half_written_last_line_of_a_killed_launch_is_left_out(tmp_path):
    (tmp_path / "metrics.csv").write_text(HEADER + "0,1e-3,4,3.0,640,\n0,1e-3,9,2.5,1280,\n0,1e-3,14,2.3e")
    metrics = curves.read_metrics(tmp_path)
    assert metrics["train/loss"] == [(5, 3.0), (10, 2.5)] and metrics["lr"] == [(5, 1e-3), (10, 1e-3), (15, 1e-3)]


@pytest.mark.plot
def test_drawing_touches_no_pyplot_state_and_importing_picks_no_backend(tmp_path):
    import matplotlib.pyplot as plt

    (tmp_path / "metrics.csv").write_text(HEADER + "0,1e-3,4,3.0,640,\n0,1e-3,9,2.5,1280,\n0,,9,,,2.6\n")
    before = plt.get_fignums()
    image = matplotlib.image.imread(curves.write_training_plot(tmp_path))  # a valid PNG
    assert image.shape[0] > 300 and image.shape[1] > 300 and plt.get_fignums() == before
    check = "import sys, posgpt.training.curves; assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_tokens_axis_is_drawn_from_the_logged_counts_and_only_then():
    metrics = {"train/loss": [(10, 2.5), (20, 2.0)], "val/loss": [(20, 2.1)], "lr": [(10, 1e-3), (20, 5e-4)],
               "train/tokens": [(10, 1280.0), (20, 2560.0)]}  # fmt: skip
    loss_ax = curves.training_figure(metrics, "run").axes[0]
    (top,) = loss_ax.child_axes
    assert top.get_xlabel() == "tokens seen"
    assert [text.get_text() for text in loss_ax.get_legend().get_texts()] == [
        "train (last 2.000)", "validation (last 2.100)"]  # fmt: skip
    assert not curves.training_figure({**metrics, "train/tokens": []}, "run").axes[0].child_axes


def test_the_perplexity_figures_legend_lies_below_the_axes_inside_the_figure():
    from posgpt.evaluation.report import ppl_figure

    labels = [f"rope + yarn, attn_window 64, variant number {i}" for i in range(12)]
    runs = [{"label": label, "train_length": 32, "results": [{"length": n, "ppl": 10.0 + i + n / 64}
             for n in (32, 64)]} for i, label in enumerate(labels)]  # fmt: skip
    doc = {"settings": {"lengths": [32, 64], "mode": "nonoverlap", "stride": None}}
    fig = ppl_figure(doc, [Group(r["label"], [r]) for r in runs])
    fig.canvas.draw()
    legend, figure, axes = fig.legends[0].get_window_extent(), fig.bbox, fig.axes[0].get_window_extent()
    assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 and figure.y0 <= legend.y0
    assert legend.y1 <= axes.y0 and not fig.axes[0].get_legend()
    assert [t.get_text() for t in fig.legends[0].get_texts()][0].startswith("rope + yarn")
