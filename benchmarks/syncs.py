"""Host syncs of a training run, counted rather than timed (so a loaded machine counts the same): every read of a
tensor's value by the host. On a GPU each one waits for the device to finish its queue.

A `TorchDispatchMode` counts `aten::_local_scalar_dense` (behind `.item()`, `float(t)`, `bool(t)`); a
`TorchFunctionMode` counts the reads that sync on a GPU but dispatch nothing on a CPU (`.tolist()`, `.cpu()`,
`.numpy()`) and the Python conversions by name. `python bench.py syncs` trains the same tiny run for N and 2N steps
and prints the syncs per extra step: 0 on steps that neither log, validate nor checkpoint.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from posgpt.core.cli import Command

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
"""Tensor methods that hand a value to the host."""


class _Scalars(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["_local_scalar_dense"] += 1
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_syncs() -> Iterator[Counter]:
    """Count the host's reads of tensor values inside the block: a Counter by op (`_local_scalar_dense`, the
    dispatcher's, and each Python-level read in `READS`; a `.item()` shows in both)."""
    counts: Counter = Counter()
    with _Reads(counts), _Scalars(counts):
        yield counts


def host_syncs(counts: Counter) -> int:
    """Syncs in `counts`: every scalar read, and every read that dispatches none (tolist, cpu, numpy)."""
    return counts["_local_scalar_dense"] + counts["tolist"] + counts["cpu"] + counts["numpy"]


@dataclass
class SyncsConfig:
    """Host syncs per training step of a tiny run on the CPU (in process; Tiny Shakespeare or a given text)."""

    input: str = "auto"
    """The text to train on (train.py's --data.input)."""
    steps: int = 20
    """N: the runs train N and 2N steps; the figure is (syncs(2N) - syncs(N)) / N."""
    log_interval: int = 10
    """train.log_interval of both runs (the steps that log)."""
    extra: list[str] = field(default_factory=list)
    """More train.py options for both runs, e.g. [--model.pos_encoding, alibi]."""


def run_counted(argv: list[str]) -> Counter:
    """The syncs of one in-process `train.py` run of `argv`."""
    import train as train_script
    from posgpt.core import cli

    with counting_syncs() as counts:
        cli.run(train_script.COMMAND, argv)
    return counts


def main(cfg: SyncsConfig) -> dict[str, Any]:
    import tempfile

    rows = {}
    for steps in (cfg.steps, 2 * cfg.steps):
        with tempfile.TemporaryDirectory() as out:
            argv = [
                "--data.input", cfg.input, "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
                "--train.precision", "32-true", "--train.max_steps", str(steps), "--train.eval_interval", "100000",
                "--train.ckpt_interval", "100000", "--train.sample_tokens", "0", "--train.progress_bar", "false",
                "--train.log_interval", str(cfg.log_interval), "--train.out_dir", out, "--train.run_name", "syncs",
                "--train.logger", "csv", *cfg.extra,
            ]  # fmt: skip
            rows[steps] = run_counted(argv)
    first, second = (host_syncs(rows[s]) for s in (cfg.steps, 2 * cfg.steps))
    per_step = (second - first) / cfg.steps
    print(f"host syncs: {first} in {cfg.steps} steps, {second} in {2 * cfg.steps}: {per_step:.2f} per step "
          f"(log_interval {cfg.log_interval}; by op, {2 * cfg.steps} steps: {dict(rows[2 * cfg.steps])})")  # fmt: skip
    sys.stdout.flush()
    return {"steps": cfg.steps, "syncs": [first, second], "per_step": per_step}


COMMAND = Command(
    "bench.py syncs",
    SyncsConfig,
    main,
    "Host syncs per training step of a tiny CPU run, counted, not timed.",
)
