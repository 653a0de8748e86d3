"""Training on several processes: the strategy a `--train.strategy` name builds (DDP, FSDP2), the sharding of a GPT
under FSDP2, and one message for a rank that stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy, Strategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch import nn

from posgpt.core.errors import ConfigError
from posgpt.training.config import SHARDED, TrainConfig


class WatchedRanks(_SubprocessScriptLauncher):
    """Lightning's launcher of a node's ranks with posgpt's watch over those it starts. Lightning's watch kills this
    process (SIGKILL) up to 5 s after a rank ends, its notice among the Lightning notices posgpt leaves out; here
    this rank meets the end at its next collective and stops with a line naming the rank (`rank_stopped`), and only
    where it has not begun to stop `timeout_s` later (a collective that hangs) does the watch say so and end the
    node's processes."""

    def __init__(self, launcher: _SubprocessScriptLauncher, timeout_s: float) -> None:
        super().__init__(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
        self.timeout_s, self.stopping = timeout_s, threading.Event()

    def launch(self, function: Callable, *args: Any, trainer: L.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            threading.Thread(target=self._watch, name="posgpt-ranks", daemon=True).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def ended(self, wait: float = 0.0) -> list[str]:
        """'rank R (PID P) ended, killed by signal 9 (Killed)' for each rank started here that ended in failure,
        waiting up to `wait` s for those still running (a rank's sockets close as it exits, a moment before its exit
        is seen)."""
        deadline, lines = time.monotonic() + wait, []
        for local, proc in enumerate(self.procs, start=1):
            with contextlib.suppress(subprocess.TimeoutExpired):
                if (code := proc.wait(max(0.0, deadline - time.monotonic()))) != 0:
                    how = f"exit status {code}" if code > 0 else f"killed by signal {-code} ({signal.strsignal(-code)})"
                    rank = self.cluster_environment.node_rank() * self.num_processes + local
                    lines.append(f"rank {rank} (PID {proc.pid}) ended, {how}")
        return lines

    def _watch(self) -> None:
        while not (ended := self.ended()):
            if all(proc.returncode == 0 for proc in self.procs):
                return
            time.sleep(1.0)
        if self.stopping.wait(self.timeout_s):  # this rank stops at its next collective (`rank_stopped`)
            return
        print(f"error: {'; '.join(ended)}, and this rank did not stop within --train.rank_timeout {self.timeout_s:g} "
              "s: the node's ranks are ended. Continue with the same command and --train.resume auto.",
              file=sys.stderr, flush=True)  # fmt: skip
        self.kill(signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


class Watched(ParallelStrategy):
    """A strategy whose collectives time out after its `timeout` (torch's default is 30 minutes) and whose launcher
    is `WatchedRanks`."""

    _timeout: timedelta | None

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher and self._timeout is not None:
            self._launcher = WatchedRanks(self._launcher, self._timeout.total_seconds())


class ShardedStrategy(Watched, ModelParallelStrategy):
    """FSDP2 through Lightning's `ModelParallelStrategy` with every rank on the data-parallel axis (its defaults put
    a node's ranks on the tensor-parallel axis, where `fully_shard` shards nothing and every rank draws the same
    batches), and checkpoints as one full state dict that rank 0 writes through the run's `CheckpointIO` (atomic:
    Lightning's sharded directory is written in place, after deleting the previous one)."""

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=False,
                         timeout=timeout)  # fmt: skip

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # the world size, known by now
        super().setup_environment()


class WatchedDDP(Watched, DDPStrategy): ...


def strategy_for(name: str, timeout_s: float) -> Strategy | str:
    """What Lightning's Trainer gets for `--train.strategy name`: DDP and FSDP2 with posgpt's watch over the ranks
    (`train.rank_timeout`); other names as they are."""
    timeout = timedelta(seconds=timeout_s)
    if name in SHARDED:
        return ShardedStrategy(timeout)
    return WatchedDDP(timeout=timeout) if name == "ddp" else name


def rank_stopped(trainer: L.Trainer, error: BaseException, timeout_s: float) -> str | None:
    """Where `error` is a collective's failure in a run of several ranks (a rank died, or did not answer within
    `timeout_s`), the line that says which rank, as this rank can tell: those it started (`WatchedRanks`: rank 0
    of a node) by their exit; of two ranks, the other one. Else None (an error of another kind)."""
    collective = isinstance(error, torch.distributed.DistError) or "gloo" in str(error)
    if trainer.world_size < 2 or not isinstance(error, RuntimeError) or not collective:
        return None
    launcher = trainer.strategy.launcher
    ended = []
    if isinstance(launcher, WatchedRanks):
        launcher.stopping.set()
        ended = launcher.ended(wait=2.0)
    other = f"rank {1 - trainer.global_rank}" if trainer.world_size == 2 else "another rank"
    said = str(error).splitlines()[0][:160]
    who = "; ".join(ended) or f"{other} ended or did not answer within --train.rank_timeout {timeout_s:g} s ({said})"
    return f"{who}, so rank {trainer.global_rank} stopped too"


def check_strategy(t: TrainConfig, precision: str) -> None:
    """Refuse, in one line before any process starts, Lightning's FSDP1 strategies and what a sharded run (`t.strategy`
    in SHARDED) cannot do."""
    if t.strategy.startswith("fsdp") and t.strategy not in SHARDED:
        raise ConfigError(f"--train.strategy {t.strategy}: posgpt shards with FSDP2, not Lightning's FSDP1 strategies: "
                          "pass --train.strategy fsdp2 (or its alias fsdp).")  # fmt: skip
    if t.strategy not in SHARDED:
        return
    refused = f"--train.strategy {t.strategy} (FSDP2)"
    if precision not in ("32-true", "bf16-mixed", "bf16-true", "16-true"):  # Lightning's ModelParallelStrategy's
        raise ConfigError(f"{refused} trains in 32-true, bf16-mixed, bf16-true or 16-true, not --train.precision "
                          f"{precision}: pass one of those (bf16-mixed where the GPU has bf16).")  # fmt: skip
    if t.switch_model:
        raise ConfigError(f"{refused} fixes the model's modules when it shards them, so it cannot switch the model "
                          "(--train.switch_model): train with --train.strategy ddp.")  # fmt: skip
    if t.fp8:
        raise ConfigError(f"{refused} with --train.fp8 is untested here: train FP8 with --train.strategy ddp.")


def shard(model: nn.Module, mesh: torch.distributed.DeviceMesh, compile_mode: str | None) -> None:
    """Shard `model` in place over `mesh` with FSDP2: each block its own unit (gathered for its forward and
    backward, freed after), the rest (embeddings and the tied output layer, the final norm, a scheme's tables) the
    root's; with `compile_mode`, each block compiled on its own (FSDP2's hooks stay between the compiled blocks).
    Parameters stay in their dtype: under mixed precision Lightning's autocast casts the matmuls, as on one device,
    and gradients are reduced in float32."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
        if compile_mode is not None:
            block.compile(mode=compile_mode)
    fully_shard(model, mesh=mesh)
