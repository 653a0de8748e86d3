"""Callbacks and the checkpoint plugin: throughput and MFU, `last.ckpt`, atomic writes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from training.hardware import peak_flops


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file in the same directory, fsync it, then rename it into
    place: a run killed mid-write leaves the previous checkpoint intact, never a truncated one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


class LastCheckpoint(L.Callback):
    """Save `<dir>/last.ckpt` every `every_n_steps` optimizer steps and when training ends."""

    def __init__(self, dirpath: Path, every_n_steps: int) -> None:
        self.path = Path(dirpath) / "last.ckpt"
        self.every_n_steps = every_n_steps
        self._saved_step = -1

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.global_step != self._saved_step:
            trainer.save_checkpoint(self.path, weights_only=False)
            self._saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and not trainer.fit_loop._should_accumulate():
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer)


class SpeedMonitor(L.Callback):
    """Tokens per second (progress bar and logs) and, on GPUs with a known peak, model FLOPs utilisation.

    Time is measured from one optimizer step's end to the next, so data loading counts and
    validation does not. MFU = flops_per_token(block_size) x tokens/s per device / peak FLOP/s.
    """

    def __init__(self, flops_per_token: int, log_every: int) -> None:
        self.flops_per_token, self.log_every = flops_per_token, log_every
        self._t0: float | None = None
        self._steps = 0
        self._peak: float | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._peak = peak_flops(trainer.strategy.root_device, str(trainer.precision))

    def _sync(self, trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        if self._t0 is None:  # the first step (and the first after validation) includes warm-up: skip it
            self._sync(trainer)
            self._t0, self._steps = time.perf_counter(), 0
            return
        self._steps += 1
        if self._steps >= self.log_every:  # synchronise only here: a sync every step would stall the GPU queue
            self._sync(trainer)
            now = time.perf_counter()
            tokens_per_s = self._steps * pl_module.tokens_per_step / (now - self._t0)
            pl_module.log("perf/tokens_per_s", tokens_per_s, prog_bar=True, rank_zero_only=True)
            if self._peak:
                per_device = tokens_per_s / trainer.world_size
                pl_module.log("perf/mfu", per_device * self.flops_per_token / self._peak, rank_zero_only=True)
            self._t0, self._steps = now, 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = None
