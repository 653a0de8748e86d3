"""`training.callbacks.optimizer_stepped`: the callbacks act exactly on the micro-batches after which
Lightning stepped the optimizer, with gradient accumulation and after a resume."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

import posgpt.training.run as run
import train as train_script
from posgpt.core import cli
from posgpt.training.callbacks import optimizer_stepped

from helpers import tiny_args


class StepRecorder(L.Callback):
    """Records (batch_idx, what `optimizer_stepped` says, whether `global_step` advanced) per micro-batch."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, bool, bool]] = []
        self._before = -1

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._before = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.rows.append((batch_idx, optimizer_stepped(trainer, batch_idx), trainer.global_step > self._before))


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> list[StepRecorder]:
    """A `StepRecorder` per training launch in the test, added to the run's callbacks."""
    made: list[StepRecorder] = []
    build = L.Trainer

    def with_recorder(**kwargs: Any) -> L.Trainer:
        made.append(StepRecorder())
        return build(**{**kwargs, "callbacks": [*kwargs["callbacks"], made[-1]]})

    monkeypatch.setattr(run.L, "Trainer", with_recorder)  # the Trainer training.run builds
    return made


@pytest.mark.parametrize("ckpt_interval", ["2", "100"])  # last.ckpt written at step 2's batch end, or at train end
def test_optimizer_stepped_is_true_exactly_when_the_optimizer_stepped(tmp_path, text_file, recorders, ckpt_interval):
    args = ["--train.grad_accum", "3", "--train.ckpt_interval", ckpt_interval, "--train.logger", "none"]
    for more in (["--train.max_steps", "2"], ["--train.max_steps", "5", "--train.resume", "auto"]):
        cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, *args, *more))
    first, resumed = (recorder.rows for recorder in recorders)
    for rows, start, steps in ((first, 0, 2), (resumed, 6, 3)):  # the resumed run goes on at micro-batch 6
        assert [batch_idx for batch_idx, _, _ in rows] == list(range(start, start + 3 * steps))
        assert [stepped for _, stepped, _ in rows] == [False, False, True] * steps
        assert all(stepped == advanced for _, stepped, advanced in rows), rows


def test_a_steps_speed_reading_is_taken_before_its_checkpoint_is_written(tmp_path, text_file, monkeypatch):
    """The tokens/s of an interval leave out the checkpoint written at its last step (the run's final
    one put a 124M trainer at 0.25 of its bare step on an H200): MetricsWriter reads the clock first."""
    from posgpt.training import callbacks

    events: list[tuple[str, int]] = []
    read, save = callbacks.MetricsWriter.on_train_batch_end, callbacks.LastCheckpoint._save

    def reading(self, trainer, *args):
        events.append(("speed", trainer.global_step))
        return read(self, trainer, *args)

    def saving(self, trainer, *args):
        events.append(("save", trainer.global_step))
        return save(self, trainer, *args)

    monkeypatch.setattr(callbacks.MetricsWriter, "on_train_batch_end", reading)
    monkeypatch.setattr(callbacks.LastCheckpoint, "_save", saving)
    argv = tiny_args(
        tmp_path, text_file, "--train.max_steps", "4", "--train.ckpt_interval", "2", "--train.logger", "none"
    )
    cli.run(train_script.COMMAND, argv)
    for step in (2, 4):
        assert events.index(("speed", step)) < events.index(("save", step)), events
