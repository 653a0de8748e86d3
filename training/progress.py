"""What a run prints while it trains: a progress bar in a terminal, else (a log file, CI) one plain line every
few steps (`step 500/2000 | loss 1.912 | 41.3 ms/step | 18.6k tok/s | ETA 1:02`) and one per validation."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from core.units import format_count, format_seconds
from training.callbacks import optimizer_stepped
from training.config import TrainConfig

log = logging.getLogger(__name__)

LINES_PER_RUN = 20  # about, when `train.print_interval` is left to choose


def progress_line(step: int, total: int, parts: list[str], eta: float | None, unit: str = "step") -> str:
    """`step k/n | part | part | ETA m:ss`: every plain progress line (a run's steps, a study's runs: `unit` "run")."""
    eta_part = [f"ETA {format_seconds(eta)}"] if eta is not None else []
    return " | ".join([f"{unit} {step}/{total}", *parts, *eta_part])


class ProgressLines(L.Callback):
    """One log line every `every` optimizer steps and one after each validation. Step time leaves out a launch's
    first step (warm-up) and validations; the ETA adds the validations to come at the last one's duration."""

    def __init__(self, every: int, eval_every: int) -> None:
        self.every, self.eval_every = every, eval_every
        self._mark: tuple[float, int, int] | None = None  # (time, step, tokens) where the clock last started
        self._interval = [0.0, 0, 0]  # seconds, steps and tokens of training since the last line
        self._train_seconds, self._train_steps = 0.0, 0
        self._val_started, self._val_seconds = 0.0, 0.0

    def _clock(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Add the training since the mark to the interval, and start the clock again."""
        now = time.perf_counter()
        if self._mark is not None:
            since, step, tokens = self._mark
            done = (now - since, trainer.global_step - step, pl_module.tokens_seen - tokens)
            self._interval = [a + b for a, b in zip(self._interval, done, strict=True)]
        self._mark = (now, trainer.global_step, pl_module.tokens_seen)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or not optimizer_stepped(trainer, batch_idx):
            return
        if self._mark is None:  # the launch's first step: the clock starts after it
            self._mark = (time.perf_counter(), step, pl_module.tokens_seen)
            return
        if step % self.every and step < trainer.max_steps:
            return
        self._clock(trainer, pl_module)
        seconds, steps, tokens = self._interval
        if steps <= 0:
            return
        self._interval = [0.0, 0, 0]
        self._train_seconds += seconds
        self._train_steps += steps
        parts = []
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            parts.append(f"loss {float(loss):.3f}")
        parts += [f"{1000 * seconds / steps:.1f} ms/step", f"{format_count(tokens / seconds)} tok/s"]
        mfu = trainer.callback_metrics.get("perf/mfu")
        if mfu is not None:
            parts.append(f"MFU {100 * float(mfu):.1f}%")
        total, eta = trainer.max_steps, None
        if step < total:  # the validations to come at the last one's duration
            validations = total // self.eval_every - step // self.eval_every
            eta = (total - step) * self._train_seconds / self._train_steps + validations * self._val_seconds
        log.info(progress_line(step, total, parts, eta))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self._mark is not None:
            self._clock(trainer, pl_module)
        self._val_started = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._val_seconds = time.perf_counter() - self._val_started
        if self._mark is not None:  # the training clock starts again after the validation
            self._mark = (time.perf_counter(), trainer.global_step, pl_module.tokens_seen)
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.is_global_zero and loss is not None:
            parts = [f"val loss {float(loss):.3f}", f"{self._val_seconds:.1f} s"]
            log.info(progress_line(trainer.global_step, trainer.max_steps, parts, None))


class ProgressBar(TQDMProgressBar):
    """Lightning's bar without the logger's version number (`v_num`)."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


def progress_callback(t: TrainConfig) -> L.Callback:
    """The bar where it is wanted and stdout is a terminal, else the plain lines (every `print_interval` steps)."""
    if t.progress_bar and sys.stdout.isatty():
        return ProgressBar()
    every = t.print_interval or max(1, round(t.max_steps / LINES_PER_RUN / t.log_interval)) * t.log_interval
    return ProgressLines(every, t.eval_interval)
