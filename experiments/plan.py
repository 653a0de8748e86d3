"""A study's plan before it starts, its progress while it runs, and its time limit.

The estimate is the training FLOPs left (`GPT.flops_per_token`) over what the device sustains (a GPU's
peak or a CPU's measured matmul rate, times a typical utilisation), recalibrated by the runs that finish.
`Deadline` is a study's `--max_minutes`: each run gets what is left of it, and the study stops in time.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.checkpoint import read_checkpoint
from core.units import format_seconds
from model import GPT, GPTConfig
from training.config import RunConfig
from training.hardware import peak_flops, resolve_precision, uses_cuda

UTILISATION = 0.35
"""Share of the peak a training step sustains (an H100 trains GPT-2 124M at ~38% MFU, BENCHMARKS.md)."""
CHAR_VOCAB = 256
"""The vocabulary assumed for a character-level model in the estimate (it is the corpus' own)."""


@dataclass
class PlannedRun:
    """One training run of a study, and how far it got."""

    label: str
    """The model's name (a scheme or a variant)."""
    name: str
    """The run's directory name, <label>-seed<S>."""
    config: RunConfig
    ckpt: Path
    step: int
    """Optimizer steps done (0: not started)."""

    @property
    def done(self) -> bool:
        return self.step >= self.config.train.max_steps

    def tokens(self) -> int:
        """Training tokens of the whole run (a synthetic task's examples are shorter: an upper bound)."""
        t = self.config.train
        return t.max_steps * t.batch_size * t.grad_accum * self.config.model.block_size


def steps_done(ckpt: Path) -> int:
    """The optimizer steps `ckpt` was written at (0 when there is none)."""
    return int(read_checkpoint(ckpt, mmap=True).get("global_step", 0)) if ckpt.is_file() else 0


def flops_per_step(config: RunConfig, vocab_size: int | None) -> float:
    """Training FLOPs of one optimizer step of `config`'s model, built on the meta device (no memory); without
    `vocab_size`, GPT-2's for BPE and `CHAR_VOCAB` for characters."""
    vocab_size = vocab_size or (GPTConfig.vocab_size if config.data.tokenizer == "gpt2" else CHAR_VOCAB)
    model_config = dataclasses.replace(config.model, vocab_size=vocab_size)
    with torch.device("meta"):
        model = GPT(model_config)
    t = config.train
    return float(model.flops_per_token(model_config.block_size)) * t.batch_size * t.grad_accum * model_config.block_size


def sustained_flops(device: torch.device, precision: str = "bf16-mixed") -> float:
    """FLOP/s a training step sustains on `device`, roughly: a GPU's peak, or a CPU's float32 matmul rate
    measured now, times `UTILISATION`."""
    peak = peak_flops(device, precision)
    if peak is None:
        a = torch.randn(512, 512)
        a @ a  # warm-up
        started, repeats = time.perf_counter(), 8
        for _ in range(repeats):
            a @ a
        peak = 2 * 512**3 * repeats / (time.perf_counter() - started)
    return peak * UTILISATION


class Progress:
    """Run k of n, and the ETA of what is left, recalibrated by the runs that finished."""

    def __init__(self, seconds_per_flop: float, step_flops: dict[str, float], device: str) -> None:
        self.seconds_per_flop, self.step_flops, self.device = seconds_per_flop, step_flops, device
        self.measured = [0.0, 0.0]  # seconds and FLOPs of the runs trained here

    @classmethod
    def of_plan(cls, plan: list[PlannedRun], vocab_size: int | None) -> Progress:
        """Before any run of `plan` (all on one device): the estimate from the FLOPs that device sustains."""
        t = plan[0].config.train
        device = torch.device("cuda" if uses_cuda(t.accelerator) else "cpu")
        sustained = sustained_flops(device, resolve_precision(t.precision, t.accelerator))
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return cls(1 / sustained, {r.name: flops_per_step(r.config, vocab_size) for r in plan}, name)

    def left(self, run: PlannedRun) -> float:
        """The FLOPs left of `run`."""
        return self.step_flops[run.name] * max(0, run.config.train.max_steps - run.step)

    def estimate(self, runs: list[PlannedRun]) -> float:
        """Seconds the training of `runs` takes, as estimated now."""
        return sum(self.left(r) for r in runs) * self.seconds_per_flop

    def finished(self, seconds: float, flops: float) -> None:
        if flops > 0:
            self.measured = [self.measured[0] + seconds, self.measured[1] + flops]
            self.seconds_per_flop = self.measured[0] / max(1.0, self.measured[1])


LONG_ON_CPU = 3600.0
"""Seconds of estimated training past which a plan on a CPU names a shorter config."""


def describe(plan: list[PlannedRun], progress: Progress, shorter: str = "") -> str:
    """The plan, a line a run, and the estimate of its training time; on a CPU past an hour, `shorter` (a config)."""
    device = progress.device
    lines = [f"Plan: {len(plan)} training run(s) on {device}"]
    for k, run in enumerate(plan, 1):
        t = run.config.train
        state = "trained, reused" if run.done else f"resumes at step {run.step}" if run.step else "to train"
        lines.append(f"  {k:>3}. {run.name}: {t.max_steps} steps x {t.batch_size * t.grad_accum} x "
                     f"{run.config.model.block_size} = {run.tokens() / 1e6:.1f}M tokens ({state})")  # fmt: skip
    todo = [r for r in plan if not r.done]
    seconds = progress.estimate(todo)
    lines.append(f"Estimated training time: {format_seconds(seconds)} for {len(todo)} run(s) "
                 f"(rough: FLOPs at {UTILISATION:.0%} of the device's peak; small models on a CPU often run faster), "
                 "then the evaluation")  # fmt: skip
    if device == "cpu" and seconds > LONG_ON_CPU and shorter:
        lines.append(f"That is long for a CPU: --config {shorter} is a first study in about 5 minutes; "
                     "--max_minutes N trains this one in pieces that resume.")  # fmt: skip
    return "\n".join(lines)


class Deadline:
    """The end of a study command's time (`max_minutes`; 0: none), on the monotonic clock."""

    def __init__(self, max_minutes: float) -> None:
        self.max_minutes = max_minutes
        self.end = time.monotonic() + 60 * max_minutes if max_minutes else None

    def minutes_left(self) -> float:
        """What is left, in minutes: 0 for no limit (as `train.max_minutes` reads it), a tiny positive number
        once it has passed (a run started then stops at its first step)."""
        if self.end is None:
            return 0.0
        return max(1e-3, (self.end - time.monotonic()) / 60)

    def passed(self, reserve: float = 0.0) -> bool:
        """Whether fewer than `reserve` seconds are left."""
        return self.end is not None and time.monotonic() + reserve >= self.end
