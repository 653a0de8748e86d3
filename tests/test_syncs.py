"""Host syncs in the training loop, counted (benchmarks/syncs.py): none on a step that neither logs, validates nor
checkpoints, a fixed few on a logging step; under DDP the stop flag is read every log_interval steps, not every step."""

from __future__ import annotations

import types

import torch

from posgpt.benchmarks.syncs import host_syncs, run_counted
from posgpt.training.callbacks import LastCheckpoint
from posgpt.training.config import TrainConfig

from helpers import tiny_args


def _syncs(tmp_path, text_file, steps: int, log_interval: int) -> int:
    options = [
        "--train.max_steps",
        str(steps),
        "--train.log_interval",
        str(log_interval),
        "--train.logger",
        "csv",
        "--train.eval_interval",
        "1000",
        "--train.ckpt_interval",
        "1000",
        "--train.precision",
        "32-true",
    ]
    argv = tiny_args(tmp_path / f"{steps}-{log_interval}", text_file, *options)
    return host_syncs(run_counted(argv))


def test_only_logging_steps_read_the_device_and_each_a_fixed_few_times(tmp_path, text_file):
    """N and 2N steps: with no logging step between, the same syncs (those of starting and ending a run); with
    one every 5 steps, at most 2 more per logging step (the metrics in one transfer, the NaN flag). Lightning's
    own logging read each metric, and re-read those of its progress bar every step: 3.1 per step before."""
    assert _syncs(tmp_path, text_file, 10, 100) == _syncs(tmp_path, text_file, 20, 100)
    extra = _syncs(tmp_path, text_file, 20, 5) - _syncs(tmp_path, text_file, 10, 5)
    assert 0 < extra <= 2 * 2  # the two logging steps of steps 11-20


def test_several_ranks_read_the_stop_flag_every_log_interval_steps(tmp_path, monkeypatch):
    """A broadcast and `.item()` every step would sync every rank every step; each rank skips the same steps."""
    broadcasts = []
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda flag, src: broadcasts.append(flag.clone()))
    callback = LastCheckpoint(tmp_path, TrainConfig(log_interval=5), deadline=None)
    trainer = types.SimpleNamespace(world_size=2, strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
    callback._signal = 15  # SIGTERM on this rank: said at the next reading, on every rank at once
    reasons = [callback._stop_reason(trainer, 0.0, step) for step in range(1, 11)]
    assert len(broadcasts) == 2 and reasons == [0, 0, 0, 0, 15, 0, 0, 0, 0, 15]
    assert callback._stop_reason(trainer, 0.0) == 15 and len(broadcasts) == 3  # validation: every time
