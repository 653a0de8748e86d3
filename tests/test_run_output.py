"""What a run prints and keeps, as a newcomer meets it: the lines of `python train.py` in a log file,
config.yaml as used, resume auto that finds nothing, one metrics file across resumes, TensorBoard,
step-numbered checkpoints (a checkpoint write that fails for a full disk: test_faults.py)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import train as train_script
from core import cli
from core.checkpoint import read_checkpoint
from training.curves import COMMAND as plot_command
from training.curves import read_metrics

from helpers import cli_error, tiny_args

ROOT = Path(__file__).resolve().parents[1]

OFFLINE_TRAIN = """
import runpy, sys, urllib.error, urllib.request
def offline(*args, **kwargs):
    raise urllib.error.URLError("no network in tests")
urllib.request.urlopen = offline
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""

ALLOWED = [
    r"Could not download Tiny Shakespeare \(.*\): training on Python's bundled documentation instead .*",
    r"Wrote prepared/\S+: \d+ train and \d+ val tokens .*",
    r"[\d.]+M parameters \(1 layers x 32, rope, block 32\) on python-\S+ \([\d,]+ tokens; validation scores "
    r"[\d,]+ of [\d,]+\); \S+ on cpu; 40 steps x 4 x 32 tokens; run dir \S+; git \S+, torch \S+",
    r"step \d+/40 \| loss [\d.]+ \| [\d.]+ ms/step \| [\d.]+k? tok/s( \| ETA \d+:\d\d)?",
    r"step \d+/40 \| val loss [\d.]+ \| [\d.]+ s",
    r"\{\"run_dir\": .*\}",
]


def test_python_train_in_a_log_file_prints_only_its_own_plain_lines(tmp_path):
    """The default command offline, stdout and stderr into a file: the offline line once, the prepare
    line, the settings line, plain progress lines, the sample and the summary; nothing else (no
    Lightning notices, model table, deprecation warnings, carriage returns or ANSI codes)."""
    env = {**os.environ, "POSGPT_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
            "--train.batch_size", "4", "--train.max_steps", "40", "--train.eval_interval", "20",
            "--train.eval_tokens", "1024", "--train.sample_tokens", "20", "--train.out_dir", str(tmp_path / "runs"),
            "--data.prepared_root", "prepared"]  # fmt: skip
    with open(tmp_path / "log.txt", "w") as log:
        done = subprocess.run([sys.executable, "-c", OFFLINE_TRAIN, *args], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=300)  # fmt: skip
    text = (tmp_path / "log.txt").read_text()
    assert done.returncode == 0, text
    assert "\r" not in text and "\x1b[" not in text
    head, sample, tail = re.split(r"^--- sample ---$|^--------------$", text, flags=re.M)
    lines = [line for line in (head + tail).splitlines() if line.strip()]
    for line in lines:
        assert any(re.fullmatch(pattern, line) for pattern in ALLOWED), f"unexpected line: {line!r}"
    assert sum("Could not download" in line for line in lines) == 1
    assert sum(line.startswith("step ") for line in lines) == 6  # every 10 steps (40 / 20, to log's 10) + 2 vals
    assert sample.strip()

    run_dir = next((tmp_path / "runs").iterdir())
    used = yaml.safe_load((run_dir / "config.yaml").read_text())
    asked = yaml.safe_load((run_dir / "requested.yaml").read_text())
    assert asked["data"]["input"] == "auto" and asked["train"]["precision"] == "auto"
    assert Path(used["data"]["input"]).name.startswith("python-") and Path(used["data"]["input"]).is_file()
    assert used["train"]["precision"] in ("bf16-mixed", "32-true")


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


def test_tensorboard_logger_writes_the_runs_events(tmp_path, text_file):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.logger", "tensorboard",
                                            "--train.max_steps", "10", "--train.eval_interval", "10"))  # fmt: skip
    events = EventAccumulator(str(tmp_path / "runs" / "tiny" / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 9]
    assert [e.step for e in events.Scalars("val/loss")] == [9]
    plot = tmp_path / "runs" / "tiny" / "training.png"  # drawn from the events, at the end and on demand
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert read_metrics(plot.parent)["val/loss"] == [(10, events.Scalars("val/loss")[0].value)]
    plot.unlink()
    cli.run(plot_command, ["--run_dir", str(plot.parent)])
    assert plot.is_file()
