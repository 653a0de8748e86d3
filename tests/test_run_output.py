"""What a run prints and keeps, as a newcomer meets it (its lines in a log file: test_entry_points.py):
resume auto that finds nothing, one metrics file across resumes, TensorBoard,
step-numbered checkpoints (a checkpoint write that fails for a full disk: test_faults.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.training.curves import COMMAND as plot_command
from posgpt.training.curves import read_metrics

from helpers import cli_error, tiny_args


def test_resume_auto_with_nothing_to_resume_says_so_and_another_runs_directory_is_refused(
    tmp_path, text_file, capsys, caplog
):
    """A run on other data into a directory with checkpoints is told to name another (a resume could not continue
    it: the refusal says what differs and what fits); into one that holds only another run's config.yaml (as a
    run killed before its first checkpoint leaves it), it may overwrite."""
    import logging

    argv = tiny_args(tmp_path, text_file, "--train.max_steps", "2", "--train.eval_interval", "2",
                     "--train.logger", "none", "--train.resume", "auto")  # fmt: skip
    with caplog.at_level(logging.INFO):
        cli.run(train_script.COMMAND, argv)
    assert "--train.resume auto: no checkpoint in" in caplog.text and "so this is a fresh run" in caplog.text
    run_dir = tmp_path / "runs" / "tiny"
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    message = cli_error(capsys, train_script.COMMAND, tiny_args(tmp_path, other, "--train.max_steps", "4"))
    assert "of another run (data.input:" in message and "--train.run_name" in message
    assert "--train.resume" not in message
    for path in run_dir.glob("*.ckpt"):  # as a run killed before its first checkpoint leaves it
        path.unlink()
    argv[argv.index(str(text_file))] = str(other)
    message = cli_error(capsys, train_script.COMMAND, argv)
    assert f"{run_dir} holds the config.yaml of another run (data.input:" in message
    assert "--train.overwrite true" in message
    cli.run(train_script.COMMAND, [*argv, "--train.overwrite", "true"])
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["input"] == str(other)


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_one_metrics_file_across_resumes_and_step_checkpoints_kept_at_an_interval(tmp_path, text_file):
    common = ["--train.eval_interval", "5", "--train.ckpt_interval", "5", "--train.keep_every", "5",
              "--train.keep_last", "2"]  # fmt: skip
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, *common, "--train.max_steps", "10"))
    run_dir = tmp_path / "runs" / "tiny"
    first = _rows(run_dir)
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, *common, "--train.max_steps", "20",
                                            "--train.resume", "auto"))  # fmt: skip
    rows = _rows(run_dir)
    assert rows[: len(first)] == first  # the first launch's rows kept as they were
    train_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    val_steps = [int(r["step"]) for r in rows if r.get("val/loss")]
    assert train_steps == [4, 9, 14, 19] and val_steps == [4, 9, 14, 19]
    assert not (run_dir / "logs").exists()
    assert sorted(p.name for p in run_dir.glob("step-*.ckpt")) == ["step-0000015.ckpt", "step-0000020.ckpt"]
    assert read_checkpoint(run_dir / "step-0000015.ckpt")["global_step"] == 15

    # a fresh run in the directory (--train.overwrite) starts the file afresh
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, *common, "--train.max_steps", "5",
                                            "--train.overwrite", "true"))  # fmt: skip
    assert [int(r["step"]) for r in _rows(run_dir) if r.get("train/loss")] == [4]
    assert [p.name for p in run_dir.glob("step-*.ckpt")] == ["step-0000005.ckpt"]


def test_tensorboard_logger_writes_the_runs_events_beside_its_metrics_csv(tmp_path, text_file, capfd):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.logger", "tensorboard",
                                            "--train.max_steps", "10", "--train.eval_interval", "10"))  # fmt: skip
    events = EventAccumulator(str(tmp_path / "runs" / "tiny" / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 9]
    assert [e.step for e in events.Scalars("val/loss")] == [9]
    plot = tmp_path / "runs" / "tiny" / "training.png"  # the run's own record, whatever the logger adds
    assert plot.read_bytes().startswith(b"\x89PNG") and (plot.parent / "metrics.csv").is_file()
    assert read_metrics(plot.parent)["val/loss"] == [(10, events.Scalars("val/loss")[0].value)]
    (plot.parent / "metrics.csv").unlink()  # a run of an older version, with TensorBoard alone: its events drawn
    plot.unlink()
    capfd.readouterr()
    cli.run(plot_command, ["--run_dir", str(plot.parent)])
    assert plot.is_file() and "No path found" not in "".join(capfd.readouterr())


def test_resume_auto_names_a_layouts_run_of_the_name_before_run_names_named_layouts(tmp_path, text_file, caplog):
    """Run names now name a layout and the layer options (issue 57): a layout's run trained before sits under the
    plain scheme's name, which `--train.resume auto` names when it finds nothing under the new one."""
    import logging

    argv = tiny_args(tmp_path, text_file, "--train.max_steps", "1", "--train.logger", "none", "--train.resume",
                     "auto", "--model.pos_encoding", "rope", "--model.n_kv_head", "1")  # fmt: skip
    del argv[argv.index("--train.run_name") : argv.index("--train.run_name") + 2]  # the name the model gives
    old = tmp_path / "runs" / f"{text_file.stem}-char-rope"
    old.mkdir(parents=True)
    (old / "last.ckpt").write_bytes(b"")
    with caplog.at_level(logging.INFO):
        cli.run(train_script.COMMAND, argv)
    assert f"--train.run_name {old.name} resumes it" in caplog.text
