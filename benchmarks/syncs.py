"""Host syncs of a training run, counted rather than timed (a loaded machine counts the same): every read of a
tensor's value by the host, which on a GPU waits for the device's queue. A `TorchDispatchMode` counts
`aten::_local_scalar_dense` (behind `.item()`, `float(t)`, `bool(t)`), a `TorchFunctionMode` the reads that sync on a
GPU but dispatch nothing on a CPU (`.tolist()`, `.cpu()`, `.numpy()`) and the Python ones by name.
`python bench.py syncs` trains a tiny run N and 2N steps and prints the syncs per step between, then the aten ops
(on a GPU in eager mode a dispatch each, most a launch) and syncs of a decoded token at GPT-2's 12 x 12 shape."""

from __future__ import annotations

import dataclasses
import tempfile
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from posgpt.core.cli import Command
from posgpt.model import GPT, GPTConfig
from posgpt.model.generation import stream

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
"""Tensor methods that hand a value to the host."""


class _Counting:  # a mode that adds what it sees to `counts`
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts


class _Scalars(_Counting, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts["_local_scalar_dense"] += func is torch.ops.aten._local_scalar_dense.default
        self.counts["ops"] += 1
        self.counts["not views"] += not (func.is_view or func is torch.ops.aten._unsafe_view.default)
        return func(*args, **(kwargs or {}))


class _Reads(_Counting, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and args and isinstance(args[0], torch.Tensor):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def host_syncs(counts: Counter) -> int:
    """Syncs in `counts`: every scalar read, and every read that dispatches none (tolist, cpu, numpy)."""
    return counts["_local_scalar_dense"] + counts["tolist"] + counts["cpu"] + counts["numpy"]


def run_counted(argv: list[str]) -> Counter:
    """The host's reads of tensor values in one in-process `posgpt train` run of `argv`, by op (a `.item()` shows twice:
    its name and `_local_scalar_dense`), and every op dispatched ("ops", "not views")."""
    from posgpt.core import cli
    from posgpt.training.command import COMMAND

    counts: Counter = Counter()
    with _Reads(counts), _Scalars(counts):
        cli.run(COMMAND, argv)
    return counts


GPT2_LAYERS = GPTConfig(vocab_size=256, block_size=64, n_layer=12, n_head=12, n_embd=48, bias=False)
"""GPT-2 124M's layers and heads, narrow: the ops of a decoded token do not depend on the width."""


def decode_counts(config: GPTConfig, tokens: int = 8) -> dict[str, float]:
    """Aten ops, those not views and host syncs of a decoded token, eager (random weights, a 1-token prompt, batch 1,
    top-k 200): (those of 1 + `tokens` tokens - those of 1) / `tokens`."""
    model, runs = GPT(config).eval(), []
    for n in (1, 1 + tokens):
        counts: Counter = Counter()
        with torch.no_grad(), _Reads(counts), _Scalars(counts):
            for _ in stream(model, torch.zeros(1, 1, dtype=torch.long), n, 1.0, 200, None, True, None,
                            torch.Generator().manual_seed(0)):  # fmt: skip
                pass
        runs.append({"ops": counts["ops"], "not views": counts["not views"], "syncs": host_syncs(counts)})
    return {key: (runs[1][key] - runs[0][key]) / tokens for key in runs[0]}


@dataclass
class SyncsConfig:
    """Host syncs per training step of a tiny run on the CPU (1 layer, 32 wide, char-level, float32); then the ops and
    syncs of a decoded token at GPT-2's 12 x 12 shape."""

    input: str = "auto"
    """The text to train on (train.py's --data.input)."""
    steps: int = 20
    """N: the runs train N and 2N steps, with no validation or checkpoint between."""
    log_interval: int = 10
    """train.log_interval of both runs."""


def main(cfg: SyncsConfig) -> None:
    counted = []
    for steps in (cfg.steps, 2 * cfg.steps):
        with tempfile.TemporaryDirectory() as out:
            counted.append(run_counted([
                "--data.input", cfg.input, "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
                "--train.precision", "32-true", "--train.max_steps", str(steps), "--train.eval_interval", "100000",
                "--train.ckpt_interval", "100000", "--train.sample_tokens", "0", "--train.progress_bar", "false",
                "--train.log_interval", str(cfg.log_interval), "--train.out_dir", out, "--train.logger", "csv",
            ]))  # fmt: skip
    first, second = map(host_syncs, counted)
    reads = {op: n for op, n in counted[1].items() if op not in ("ops", "not views")}
    print(f"host syncs: {first} in {cfg.steps} steps, {second} in {2 * cfg.steps}: {(second - first) / cfg.steps:.2f} "
          f"per step (log_interval {cfg.log_interval}; reads by op: {reads})")  # fmt: skip
    for scheme in ("learned", "rope"):
        print(f"a decoded token, {scheme}:", decode_counts(dataclasses.replace(GPT2_LAYERS, pos_encoding=scheme)))


COMMAND = Command("bench.py syncs", SyncsConfig, main, "Host syncs per training step, ops a decoded token, counted.")
