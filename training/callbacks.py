"""Callbacks and the checkpoint plugin: throughput and MFU, `last.ckpt` (also on a signal; never a diverged model),
and what a run prints while it trains: a progress bar in a terminal, else (a log file, CI) one plain line every few
steps (`step 500/2000 | loss 1.912 | 41.3 ms/step | 18.6k tok/s | ETA 1:02`) and one per validation."""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO

from posgpt.core.errors import TIME_LIMIT_EXIT, TrainingDiverged, TrainingStopped, UserError
from posgpt.core.files import atomic_file
from posgpt.core.units import format_count, progress_line
from posgpt.training.config import TrainConfig
from posgpt.training.hardware import peak_flops

log = logging.getLogger(__name__)

# what torch.save's zip writer says when the file it writes cannot grow (a full disk, through a file object)
TORCH_WRITE_ERRORS = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint atomically: a run killed mid-write leaves the previous checkpoint intact. A write that
    fails for lack of space (or of a working disk) ends in one line naming the disk and what was kept."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_file(path, hidden=True) as f:
                torch.save(checkpoint, f)
        except (OSError, RuntimeError) as error:
            full = isinstance(error, OSError) and error.errno == errno.ENOSPC
            if not full and not any(text in str(error) for text in TORCH_WRITE_ERRORS):
                raise  # a bug
            free = shutil.disk_usage(path.parent).free
            failed = f"the write failed ({str(error).splitlines()[0][:120]})"
            what = "no space left" if full or free < (64 << 20) else failed
            kept = f"the previous {path} is intact" if path.is_file() else f"no earlier {path.name} was there"
            parent = path.parent.resolve()  # its mount point: how a user finds the disk to free
            mount = next(p for p in (parent, *parent.parents) if os.path.ismount(p) or p == p.parent)
            raise UserError(
                f"Could not write {path}: {what} on the disk mounted at {mount} ({free / 2**20:.0f} MB free); "
                f"{kept}. Free some space and continue with the same command and --train.resume auto."
            ) from None


def optimizer_stepped(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether the micro-batch `batch_idx` ended with an optimizer step: Lightning's private
    `fit_loop._should_accumulate()` on public API (the training stream is one endless epoch)."""
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0


DEADLINE = -1  # the stop reason of a run past its time limit (signals are their positive numbers)


class LastCheckpoint(L.Callback):
    """Save `<run dir>/last.ckpt` every `t.ckpt_interval` optimizer steps, before every validation, at the end, and
    at the first step after a SIGTERM or SIGINT or past `deadline` (monotonic; with a reserve of twice the
    longest step and save), then stop with `TrainingStopped`. A second Ctrl+C stops at once, without saving.
    A NaN or inf loss or weight stops training with `TrainingDiverged` before anything of it is saved; the
    module's loss flag is read (a synchronisation) only on logging, checkpoint and evaluation steps and at the end.

    Not Lightning's own: its SIGTERM handling stops at any micro-batch without a checkpoint and it has no SIGINT
    stop, its Timer stops without a checkpoint, nor counts data preparation, nor keeps a reserve for the save,
    and ModelCheckpoint writes a second copy for each step-numbered checkpoint (ours are hard links)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, run_dir: Path, t: TrainConfig, deadline: float | None) -> None:
        self.path, self.t, self.deadline = run_dir / "last.ckpt", t, deadline
        self.check_every = (t.log_interval, t.ckpt_interval, t.eval_interval)  # the steps the loss flag is read
        self.saved_step = -1  # the step of the last checkpoint this run wrote
        self._signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._longest_step, self._longest_save = 0.0, 2.0  # a guess until the first save is timed
        self._step_ended: float | None = None  # None: a launch's first step (warm-up) is not timed

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.saved_step:
            return
        if not bool(torch.stack([torch.isfinite(p).all() for p in pl_module.parameters()]).all()):  # one sync
            raise self._diverged(trainer.global_step)
        started = time.monotonic()
        trainer.save_checkpoint(self.path, weights_only=False)
        self._longest_save = max(self._longest_save, time.monotonic() - started)
        self.saved_step = step = trainer.global_step
        if not self.t.keep_every or step % self.t.keep_every or not trainer.is_global_zero:
            return
        kept = self.path.with_name(f"step-{step:07d}.ckpt")  # last.ckpt kept under its step too
        kept.unlink(missing_ok=True)
        try:
            os.link(self.path, kept)  # a hard link where it can
        except OSError:  # a file system without hard links
            shutil.copyfile(self.path, kept)
        if self.t.keep_last:  # only the latest keep_last of those
            for old in sorted(self.path.parent.glob("step-*.ckpt"))[: -self.t.keep_last]:
                old.unlink(missing_ok=True)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # the handlers to restore: those from before Lightning's own SIGTERM handler, which it installs after
        # this hook and removes before our teardown (restoring its handler would leave it in for good)
        self._previous = {signum: signal.getsignal(signum) for signum in self.SIGNALS}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # on every rank (a scheduler signals them all), though rank 0's signal decides: see `_stop_reason`
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl+C: stop now
        self._signal = signum

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not optimizer_stepped(trainer, batch_idx):
            return
        step = trainer.global_step
        if (any(step % n == 0 for n in self.check_every) or step >= trainer.max_steps) and bool(pl_module.nonfinite):
            raise self._diverged(step)
        if self._step_ended is not None:
            self._longest_step = max(self._longest_step, time.monotonic() - self._step_ended)
        steps = self.t.log_interval if trainer.world_size > 1 else 1  # till the next reading of the stop flag
        if reason := self._stop_reason(trainer, (steps + 1) * self._longest_step + 2 * self._longest_save, step):
            self._save(trainer, pl_module)
            self._stop(reason, step)
        validation_next = step >= trainer.max_steps or step % self.t.eval_interval == 0
        if step > 0 and (step % self.t.ckpt_interval == 0 or validation_next):
            self._save(trainer, pl_module)
        self._step_ended = time.monotonic()

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        if reason := self._stop_reason(trainer, reserve=0.0):
            self._stop(reason, trainer.global_step, " during validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_ended = time.monotonic()  # validation is not a training step
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not math.isfinite(float(loss)):
            raise self._diverged(trainer.global_step)

    def _stop(self, reason: int, step: int, where: str = "") -> None:
        timed_out = reason == DEADLINE
        what = "Time limit (--train.max_minutes) reached" if timed_out else f"Stopped by {signal.Signals(reason).name}"
        saved = f"saved {self.path}" if self.saved_step == step else f"{self.path} holds step {self.saved_step}"
        raise TrainingStopped(
            f"{what} at step {step}{where}; {saved}. Continue with the same command and --train.resume auto.",
            TIME_LIMIT_EXIT if timed_out else 128 + reason,
        )

    def _stop_reason(self, trainer: L.Trainer, reserve: float, step: int | None = None) -> int:
        """A signal's number, `DEADLINE`, or 0 (go on); rank 0's, broadcast, so that every rank stops together. At
        training `step`, several ranks read it every `log_interval` steps only (a broadcast is a host sync): each
        rank skips the same steps, so all stop at the same one."""
        distributed = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and step is not None and step % self.t.log_interval:
            return 0
        reason = self._signal or 0
        if not reason and self.deadline is not None and time.monotonic() + reserve >= self.deadline:
            reason = DEADLINE
        if distributed:
            flag = torch.tensor([reason], device=trainer.strategy.root_device)
            torch.distributed.broadcast(flag, src=0)
            reason = int(flag.item())
        return reason

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Put back the handlers from before training, for a process that goes on after the run (a test, a notebook)."""
        for signum, handler in self._previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signum, handler)
        self._previous = {}

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown hook when fit raises (TrainingStopped)

    def _diverged(self, step: int) -> TrainingDiverged:
        saved = f"{self.path} is from before this launch" if self.path.is_file() else "no checkpoint was written"
        if self.saved_step >= 0:
            saved = f"the last good checkpoint is {self.path} (step {self.saved_step})"
        return TrainingDiverged(
            f"Training diverged: the loss or the weights are NaN or inf by step {step}; {saved}, and it was not "
            "overwritten. Try a lower --optim.lr, a smaller --optim.grad_clip or a longer --optim.warmup_steps, "
            "or --train.precision 32-true; resume from a good checkpoint with --train.resume PATH."
        )


class MetricsWriter(L.Callback):
    """Tokens per second and, on GPUs with a known peak, MFU (flops_per_token x tokens/s per device / peak), from
    one step's end to the next: data loading counts, validation does not. Then a logging step's metrics
    (`pl_module.pending`) read in one transfer from the device and handed to every logger as floats: no step syncs
    the host but a logging step, once (Lightning's `self.log` reads each metric on its own, and re-reads those shown
    in the bar every batch); on several ranks the loss is their mean. Put it first, so that a step's checkpoint is
    written after its reading, and the progress lines show its metrics."""

    def __init__(self, flops_per_token: int, log_every: int) -> None:
        self.flops_per_token, self.log_every = flops_per_token, log_every
        self._t0: float | None = None  # the clock's start, with the step count and tokens since
        self._steps, self._tokens0 = 0, 0
        self._peak: float | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._peak = peak_flops(trainer.strategy.root_device, str(trainer.precision))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not optimizer_stepped(trainer, batch_idx):
            return
        self._read_speed(trainer, pl_module)
        if not (pending := pl_module.pending):
            return
        if trainer.world_size > 1 and "train/loss" in pending:  # the mean over ranks (a sum: gloo has no mean)
            total = pending["train/loss"].clone()
            torch.distributed.all_reduce(total)
            pending["train/loss"] = total / trainer.world_size
        names = [name for name, value in pending.items() if isinstance(value, torch.Tensor)]
        read = torch.stack([pending[n].float() for n in names]).tolist() if names else []  # the one sync
        metrics = {n: float(v) for n, v in pending.items() if n not in names} | dict(zip(names, read, strict=True))
        pending.clear()
        pl_module.logged.update(metrics)
        for logger in trainer.loggers:  # the step as Lightning numbers it: optimizer steps before this one
            logger.log_metrics({**metrics, "epoch": trainer.current_epoch}, step=trainer.global_step - 1)
            logger.save()

    def _read_speed(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._t0 is not None:  # else the first step (and the first after validation): warm-up, not timed
            self._steps += 1
            if self._steps < self.log_every:  # synchronise only to read: a sync every step would stall the GPU queue
                return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._t0 is not None:
            tokens_per_s = (pl_module.tokens_seen - self._tokens0) / (now - self._t0)
            pl_module.pending["perf/tokens_per_s"] = tokens_per_s  # floats: written with the step's other metrics
            if self._peak:
                pl_module.pending["perf/mfu"] = tokens_per_s / trainer.world_size * self.flops_per_token / self._peak
        self._t0, self._steps, self._tokens0 = now, 0, pl_module.tokens_seen

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = None


class ProgressLines(L.Callback):
    """One log line every `t.print_interval` optimizer steps and one after each validation. Step time leaves out a
    launch's first step (warm-up) and validations; the ETA adds the validations to come at the last one's duration."""

    def __init__(self, t: TrainConfig) -> None:
        self.every = t.print_interval or max(1, round(t.max_steps / 20 / t.log_interval)) * t.log_interval  # ~20 lines
        self.eval_every = t.eval_interval
        self._mark: tuple[float, int, int, float] | None = None  # (time, step, tokens, validation seconds) at a line
        self._train = [0.0, 0]  # seconds and steps of training timed in this launch
        self._val_started, self._val_seconds, self._val_total = 0.0, 0.0, 0.0  # the last validation's seconds, all

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or not optimizer_stepped(trainer, batch_idx):
            return
        mark = (time.perf_counter(), step, pl_module.tokens_seen, self._val_total)
        if self._mark is None:  # the launch's first step: the clock starts after it
            self._mark = mark
            return
        if step % self.every and step < trainer.max_steps:
            return
        seconds = mark[0] - self._mark[0] - (mark[3] - self._mark[3])  # the validations since left out
        steps, tokens = step - self._mark[1], mark[2] - self._mark[2]  # steps > 0: each call is a new step
        self._mark = mark
        self._train = [self._train[0] + seconds, self._train[1] + steps]
        metrics = pl_module.logged  # floats of the last logging step: no sync
        parts = [f"loss {metrics['train/loss']:.3f}"] if "train/loss" in metrics else []
        parts += [f"{1000 * seconds / steps:.1f} ms/step", f"{format_count(tokens / seconds)} tok/s"]
        if "perf/mfu" in metrics:
            parts.append(f"MFU {100 * metrics['perf/mfu']:.1f}%")
        total, eta = trainer.max_steps, None
        if step < total:  # the validations to come at the last one's duration
            validations = total // self.eval_every - step // self.eval_every
            eta = (total - step) * self._train[0] / self._train[1] + validations * self._val_seconds
        log.info(progress_line(step, total, parts, eta))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_started = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_seconds = time.perf_counter() - self._val_started
        self._val_total += self._val_seconds
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.is_global_zero and loss is not None:
            parts = [f"val loss {float(loss):.3f}", f"{self._val_seconds:.1f} s"]
            log.info(progress_line(trainer.global_step, trainer.max_steps, parts, None))


class ProgressBar(TQDMProgressBar):
    """Lightning's bar without the logger's version number (`v_num`)."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        shown = {"train/loss": "loss", "perf/tokens_per_s": "tok/s", "val/loss": "val"}  # the last logged, as floats
        return items | {
            short: f"{pl_module.logged[name]:.4g}" for name, short in shown.items() if name in pl_module.logged
        }
