"""Stopping early and going on: a SIGTERM during a validation, and `--train.max_minutes`; each ends
with a checkpoint and one line, and the resumed run ends where an uninterrupted one does; a resume that
moves the learning rate says so."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import train as train_script
from core import cli
from core.checkpoint import read_checkpoint

from helpers import tiny_args


def _stopped(capsys, argv: list[str], code: int) -> str:
    """The line a tiny run that stops early ends with; checks its exit status and that it is no traceback."""
    with pytest.raises(SystemExit) as info:
        cli.run(train_script.COMMAND, argv)
    err = capsys.readouterr().err
    assert info.value.code == code, err[-2000:]
    return err.strip().splitlines()[-1]


def _same_weights(a: Path, b: Path) -> bool:
    x, y = (read_checkpoint(d / "runs" / "tiny" / "last.ckpt")["state_dict"] for d in (a, b))
    return all(torch.equal(x[k], y[k]) for k in y)


def test_a_sigterm_during_validation_stops_it_and_resume_is_exact(tmp_path, text_file, monkeypatch, capsys):
    """A SIGTERM in the middle of a validation (a real signal, sent from its second batch) stops the run
    there, with the step saved before the validation began; the resumed run ends where an uninterrupted one does."""
    from training.module import GPTModule

    common = ["--train.logger", "none", "--train.eval_interval", "8", "--train.ckpt_interval", "100",
              "--train.eval_tokens", "0", "--train.max_steps", "12"]  # fmt: skip
    validate = GPTModule.validation_step

    def signalled(self, batch, batch_idx):
        if self.global_step == 8 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return validate(self, batch, batch_idx)

    killed, straight = tmp_path / "killed", tmp_path / "straight"
    with monkeypatch.context() as patch:
        patch.setattr(GPTModule, "validation_step", signalled)
        line = _stopped(capsys, tiny_args(killed, text_file, *common), 128 + signal.SIGTERM)
    assert line.startswith("Stopped by SIGTERM at step 8 during validation; saved"), line
    assert read_checkpoint(killed / "runs" / "tiny" / "last.ckpt")["global_step"] == 8
    cli.run(train_script.COMMAND, tiny_args(killed, text_file, *common, "--train.resume", "auto"))
    cli.run(train_script.COMMAND, tiny_args(straight, text_file, *common))
    assert _same_weights(killed, straight)


def test_max_minutes_stops_with_a_checkpoint_and_status_75_and_resume_is_exact(tmp_path, text_file, capsys):
    common = ["--train.logger", "none", "--train.max_steps", "10"]
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    # 1.2 s: less than the reserve kept for a save before the first one is timed, so it stops at once
    line = _stopped(capsys, tiny_args(killed, text_file, *common, "--train.max_minutes", "0.02"), 75)
    assert line.startswith("Time limit (--train.max_minutes) reached at step 1; saved"), line
    cli.run(train_script.COMMAND, tiny_args(killed, text_file, *common, "--train.resume", "auto"))
    cli.run(train_script.COMMAND, tiny_args(straight, text_file, *common))
    assert _same_weights(killed, straight)


def test_a_resume_that_moves_the_learning_rate_says_so(tmp_path, text_file, caplog):
    """The cosine ends at max_steps: resumed at step 6 with --train.max_steps 7 (the checkpoint's schedule
    ended at 6, at min_lr) the rate jumps; one line says from what to what."""
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.logger", "none", "--train.max_steps", "6"))
    with caplog.at_level("INFO", logger="training.run"):
        argv = tiny_args(
            tmp_path, text_file, "--train.logger", "none", "--train.max_steps", "7", "--train.resume", "auto"
        )
        cli.run(train_script.COMMAND, argv)
    assert "Resuming with train.max_steps: 6 -> 7" in caplog.text
    assert "Resuming with the learning rate at step 6: 0.0001 -> 0.00155 at once" in caplog.text
