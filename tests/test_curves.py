"""Figures people look at: a run's training curves (one series across launches), and the
loss-by-position figure's legend and training-length marker."""

from __future__ import annotations

import pytest

from core import cli
from core.errors import UserError
from evaluation import curves
from evaluation.report import TRAIN_LENGTH_LINE, Group, line_style, position_figure

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


def _doc(labels: list[str], length: int = 64) -> tuple[dict, list[Group]]:
    starts = [0, 16, 32, 48]
    runs = [{"label": label, "train_length": 32, "results": [{"length": length, "applicable": True,
             "bucket_starts": starts, "by_position": [3.0 - 0.1 * i, 2.5, 2.4, 2.6]}]}
            for i, label in enumerate(labels)]  # fmt: skip
    return {"settings": {"lengths": [length]}}, [Group(r["label"], [r]) for r in runs]


def test_the_loss_by_position_legend_fits_and_the_training_length_is_no_models_colour():
    labels = [f"rope + yarn, attn_window 64, seed average {i}" for i in range(12)]
    doc, groups = _doc(labels)
    fig = position_figure(doc, groups)
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    figure = fig.bbox
    assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 and figure.y0 <= legend.y0
    for ax in fig.axes:  # the panels sit above the legend
        if ax.lines:
            assert ax.get_window_extent().y0 >= legend.y1 - 1
    marker = [line for line in fig.axes[0].lines if line.get_linestyle() == TRAIN_LENGTH_LINE["linestyle"]]
    assert marker and marker[0].get_color() == TRAIN_LENGTH_LINE["color"]
    styles = {(line_style(i)["color"], line_style(i)["linestyle"]) for i in range(30)}
    assert (TRAIN_LENGTH_LINE["color"], TRAIN_LENGTH_LINE["linestyle"]) not in styles
