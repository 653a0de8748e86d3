"""Stopping early and going on: a SIGTERM during a validation, and `--train.max_minutes`; each ends
with a checkpoint and one line, and the resumed run ends where an uninterrupted one does (a resume that
moves the learning rate says so: test_faults.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint

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


def test_a_sigterm_during_validation_and_a_time_limit_stop_with_a_checkpoint_and_resume_exactly(
    tmp_path, text_file, monkeypatch, capsys
):
    """A SIGTERM in the middle of a validation (a real signal, sent from its second batch) stops the run
    there, with the step saved before the validation began; `--train.max_minutes` stops one with status 75.
    Each resumed run ends where an uninterrupted one does."""
    from posgpt.training.module import GPTModule

    common = ["--train.logger", "none", "--train.eval_interval", "8", "--train.ckpt_interval", "100",
              "--train.eval_tokens", "0", "--train.max_steps", "12"]  # fmt: skip
    validate = GPTModule.validation_step

    def signalled(self, batch, batch_idx):
        if self.global_step == 8 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return validate(self, batch, batch_idx)

    killed, timed, straight = tmp_path / "killed", tmp_path / "timed", tmp_path / "straight"
    cli.run(train_script.COMMAND, tiny_args(straight, text_file, *common))
    with monkeypatch.context() as patch:
        patch.setattr(GPTModule, "validation_step", signalled)
        line = _stopped(capsys, tiny_args(killed, text_file, *common), 128 + signal.SIGTERM)
    assert line.startswith("Stopped by SIGTERM at step 8 during validation; saved"), line
    assert read_checkpoint(killed / "runs" / "tiny" / "last.ckpt")["global_step"] == 8
    cli.run(train_script.COMMAND, tiny_args(killed, text_file, *common, "--train.resume", "auto"))
    assert _same_weights(killed, straight)

    # 1.2 s: less than the reserve kept for a save before the first one is timed, so it stops at once
    line = _stopped(capsys, tiny_args(timed, text_file, *common, "--train.max_minutes", "0.02"), 75)
    assert line.startswith("Time limit (--train.max_minutes) reached at step 1; saved"), line
    cli.run(train_script.COMMAND, tiny_args(timed, text_file, *common, "--train.resume", "auto"))
    assert _same_weights(timed, straight)
