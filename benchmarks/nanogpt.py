"""Our train.py against nanoGPT's, as separate processes (`python bench.py vs-nanogpt`).

It runs nanoGPT's own train.py (a scratch copy of the peer, outside the project) and our train.py
with default flags, at one shape, for two run lengths each, rounds interleaved A B B A: the per-step
cost is the difference of the wall times over the difference of the step counts, so start-up, the
evaluation and the final checkpoint cancel out.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from posgpt.benchmarks.common import ROOT
from posgpt.benchmarks.gpu import logged_tokens_per_s
from posgpt.core.cli import Command
from posgpt.data.prepare import prepare

SHAPES = {
    # nanoGPT's README laptop command
    "cpu": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12},
    # its shakespeare_char recipe's model, at a CPU batch
    "6x384": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "batch_size": 8},
}


def nanogpt_command(shape: dict[str, int], steps: int, out: Path) -> list[str]:
    """nanoGPT's laptop command at `shape`, evaluating only at step 0 and saving nothing."""
    flags = {**shape, "device": "cpu", "compile": False, "eval_iters": 20, "log_interval": 1, "dropout": 0.0,
             "max_iters": steps, "lr_decay_iters": steps, "eval_interval": 10**9, "out_dir": str(out)}  # fmt: skip
    return [sys.executable, "train.py", "config/train_shakespeare_char.py", *(f"--{k}={v}" for k, v in flags.items())]


def our_command(data_dir: Path, shape: dict[str, int], steps: int, out: Path, extra: list[str]) -> list[str]:
    """Our train.py with its default flags at `shape` (learned positions, as nanoGPT), one evaluation
    (at the end, 20 batches as nanoGPT's) and one checkpoint."""
    eval_tokens = 20 * shape["batch_size"] * shape["block_size"]
    args = [f"--model.{k}={v}" for k, v in shape.items() if k != "batch_size"] + [
        f"--train.batch_size={shape['batch_size']}", "--model.pos_encoding=learned", f"--data.dir={data_dir}",
        f"--train.max_steps={steps}", f"--train.eval_interval={steps}", f"--train.ckpt_interval={steps}",
        f"--train.eval_tokens={eval_tokens}", "--train.sample_tokens=0", f"--train.out_dir={out}",
        f"--train.run_name=bench-{shape['batch_size'] * shape['block_size']}-{steps}", "--train.log_interval=10",
        "--train.overwrite=true",  # rounds repeat a run length in the same directory
    ]  # fmt: skip
    return [sys.executable, str(ROOT / "train.py"), *args, *extra]


def timed_run(command: list[str], cwd: Path) -> tuple[float, str]:
    """Wall time and stdout of a command that must succeed."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - start, result.stdout


def logged_step_ms(kind: str, stdout: str, run_dir: Path, tokens: int) -> float:
    """The median step time a run logged itself: nanoGPT prints each iteration's time (the first
    five left out: warm-up); ours logs tokens/s every log_interval steps (its first step left out)."""
    if kind == "nanoGPT":
        times = [float(line.split("time ")[1].split("ms")[0]) for line in stdout.splitlines() if "time " in line]
        return statistics.median(times[5:])
    return 1000 * tokens / statistics.median(logged_tokens_per_s(run_dir))


@dataclass
class VsNanoGPTConfig:
    """Our train.py against nanoGPT's, per-step cost, CPU."""

    peer: str
    """nanoGPT's directory (copied to a scratch directory)."""
    input: str
    """A text file, e.g. ../shared/data/tinyshakespeare.txt."""
    shape: Literal["6x384", "cpu"] = "cpu"
    """The model and batch (see SHAPES)."""
    steps: tuple[int, int] = (50, 250)
    """The two run lengths."""
    rounds: int = 1
    """ABBA rounds."""
    ours_args: list[str] = field(default_factory=list)
    """Extra flags for our train.py, e.g. [--train.compile=true]."""


def bench_vs_nanogpt(args: VsNanoGPTConfig) -> None:
    shape = SHAPES[args.shape]
    short, long = args.steps
    tokens = shape["batch_size"] * shape["block_size"]
    per_step: dict[str, list[float]] = {"ours": [], "nanoGPT": []}
    logged: dict[str, list[float]] = {"ours": [], "nanoGPT": []}
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "nanoGPT"
        shutil.copytree(args.peer, peer)  # a scratch copy: the peer is run, never imported or copied in
        data = peer / "data" / "shakespeare_char"
        shutil.copy(args.input, data / "input.txt")
        subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
        ours_data, ours_runs = Path(tmp) / "ours-data", Path(tmp) / "runs"
        prepare(args.input, str(ours_data), "char")
        commands = {
            "nanoGPT": lambda n: (nanogpt_command(shape, n, Path(tmp) / f"nano-{n}"), peer),
            "ours": lambda n: (our_command(ours_data, shape, n, ours_runs, args.ours_args), ROOT),
        }
        for kind in ("ours", "nanoGPT", "nanoGPT", "ours") * args.rounds:
            runs = {n: timed_run(*commands[kind](n)) for n in (short, long)}
            per_step[kind].append((runs[long][0] - runs[short][0]) / (long - short))
            logged[kind].append(logged_step_ms(kind, runs[long][1], ours_runs / f"bench-{tokens}-{long}", tokens))
            print(f"{kind:8s} {short} steps {runs[short][0]:6.1f} s, {long} steps {runs[long][0]:6.1f} s: "
                  f"{1000 * per_step[kind][-1]:.1f} ms/step (its own log: {logged[kind][-1]:.1f})",
                  flush=True)  # fmt: skip
    ours, nano = statistics.median(per_step["ours"]), statistics.median(per_step["nanoGPT"])
    print(f"shape {args.shape} {shape}, ours {' '.join(args.ours_args)}")
    print(f"median ms/step from the two lengths: ours {1000 * ours:.1f} ({tokens / ours:,.0f} tokens/s), nanoGPT "
          f"{1000 * nano:.1f} ({tokens / nano:,.0f} tokens/s): ours {nano / ours:.2f}x nanoGPT's tokens/s")  # fmt: skip
    ours_log, nano_log = statistics.median(logged["ours"]), statistics.median(logged["nanoGPT"])
    print(
        f"median ms/step from the runs' own logs: ours {ours_log:.1f}, nanoGPT {nano_log:.1f}: "
        f"ours {nano_log / ours_log:.2f}x"
    )


COMMAND = Command("bench.py vs-nanogpt", VsNanoGPTConfig, bench_vs_nanogpt, VsNanoGPTConfig.__doc__, logs=False)
