"""The trainer against a hand-written loop (`python bench.py train-step | plain-run | val-noise`).

`train-step` times optimizer steps at one shape (`--shape cpu`: nanoGPT's CPU config, `6x384`: its
shakespeare_char model at batch 8; learned positions) two ways, interleaved A B B A so that the
machine's drift hits both alike:
  A: the Lightning trainer (`training.run.train`, as `python train.py` runs it);
  B: a hand-written PyTorch loop in the style of nanoGPT's train.py, on the same model, data and
     optimizer (np.memmap batches, forward, backward, clip, AdamW step).
It prints the median tokens/s of each (`python bench.py precision --profile L C T B` shows where
the time of B's step goes, operator by operator). `plain-run` trains B for a whole run and
reports the val loss the trainer would log (every fixed window of the validation split), so the two
can be compared on loss as well as speed. `val-noise` measures how noisy nanoGPT's own val estimate is.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from benchmarks.nanogpt import SHAPES
from core.cli import Command
from data.dataset import load_prepared
from data.prepare import prepare
from evaluation.checkpoint import load_checkpoint
from evaluation.extrapolation import evaluate_length
from model import GPT, GPTConfig
from training.config import DataConfig, OptimConfig, RunConfig, TrainConfig, lr_factor
from training.logs import metrics_file
from training.run import train

SHAPE = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False, pos_encoding="learned")
BATCH = 12


@dataclass(frozen=True)
class StepShape:
    """The model and batch of a timed step, and the precision both sides train in."""

    model: GPTConfig = SHAPE
    batch: int = BATCH
    precision: str = "32-true"

    @classmethod
    def named(cls, name: str, precision: str) -> StepShape:
        """`SHAPES[name]` of benchmarks.nanogpt (learned positions, no biases, a char vocabulary)."""
        shape = SHAPES[name]
        model = {k: shape[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
        config = GPTConfig(vocab_size=65, bias=False, pos_encoding="learned", **model)
        return cls(config, shape["batch_size"], precision)

    @property
    def tokens(self) -> int:
        return self.batch * self.model.block_size


def lightning_run(data_dir: Path, out: Path, steps: int, shape: StepShape, log_interval: int = 25) -> Path:
    """Train `steps` steps through the trainer; its run directory."""
    cfg = RunConfig(
        model=shape.model,
        data=DataConfig(input=None, dir=str(data_dir)),
        optim=OptimConfig(beta2=0.99),
        train=TrainConfig(
            max_steps=steps,
            batch_size=shape.batch,
            eval_interval=10**9,
            eval_tokens=shape.tokens,  # the one validation at the end: one batch
            log_interval=log_interval,
            out_dir=str(out),
            run_name="lightning",
            overwrite=True,  # each round starts afresh in the same directory
            progress_bar=False,
            sample_tokens=0,
            precision=shape.precision,
        ),
    )
    return train(cfg).run_dir


def lightning_tokens_per_s(data_dir: Path, out: Path, steps: int, shape: StepShape = StepShape()) -> float:
    """Median of the trainer's own tokens/s readings (SpeedMonitor, every 25 steps or a third of a
    short run, warm-up excluded)."""
    run_dir = lightning_run(data_dir, out, steps, shape, log_interval=min(25, max(1, steps // 3)))
    rows = metrics_file(run_dir).read_text().splitlines()
    header = rows[0].split(",")
    col = header.index("perf/tokens_per_s")
    values = [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]
    return statistics.median(values)


def plain_loop_tokens_per_s(data_dir: Path, steps: int, shape: StepShape = StepShape()) -> float:
    """nanoGPT-style loop; median over steps (the first 10, or the first few of a short run, excluded as warm-up)."""
    _, times = plain_loop(data_dir, steps, seed=1337, shape=shape)
    return shape.tokens / statistics.median(times[min(10, steps // 4) :])


def whole_split_loss(model: GPT, data_dir: Path) -> float:
    """Mean loss over every fixed window of the validation split (what the trainer logs as val/loss)."""
    val = load_prepared(data_dir).tokens("val")
    return evaluate_length(model, val, model.config.block_size, token_budget=len(val), batch_size=64).loss


def plain_loop(data_dir: Path, steps: int, seed: int, shape: StepShape = StepShape()) -> tuple[GPT, list[float]]:
    """Train `shape` with a hand-written loop in the style of nanoGPT's train.py; return the model and
    the wall time of every step. bf16-mixed runs the forward pass under CPU autocast."""
    torch.manual_seed(seed)
    model = GPT(shape.model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape.precision == "bf16-mixed")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99)
    )
    T, batch = shape.model.block_size, shape.batch
    times = []
    for step in range(steps):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * lr_factor(step, 1e-3, 1e-4, 100, steps)
        data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - T, (batch,))
        x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in ix])
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return model, times


@dataclass
class TrainStepConfig:
    """Lightning trainer vs a hand-written loop, tokens/s on CPU."""

    input: str
    """A text file, e.g. ../shared/data/tinyshakespeare.txt."""
    steps: int = 300
    """Optimizer steps per timed run."""
    rounds: int = 2
    """ABBA rounds."""
    shape: Literal["cpu", "6x384"] = "cpu"
    """cpu: nanoGPT's CPU config (4 x 4 x 128, block 64, batch 12); 6x384: its shakespeare_char model
    (6 x 6 x 384, block 256) at batch 8."""
    precision: Literal["32-true", "bf16-mixed"] = "32-true"
    """What both sides train in."""


def bench_train_step(args: TrainStepConfig) -> None:
    """Tokens/s of A and B, interleaved A B B A; the median of each."""
    shape = StepShape.named(args.shape, args.precision)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(args.input, str(data_dir), "char")
        results: dict[str, list[float]] = {"lightning": [], "plain": []}
        for _ in range(args.rounds):
            for kind in ("lightning", "plain", "plain", "lightning"):
                if kind == "lightning":
                    results[kind].append(lightning_tokens_per_s(data_dir, Path(tmp) / "runs", args.steps, shape))
                else:
                    results[kind].append(plain_loop_tokens_per_s(data_dir, args.steps, shape))
                print(f"{kind:9s} {results[kind][-1]:9.0f} tokens/s", flush=True)
    for kind, values in results.items():
        median = statistics.median(values)
        print(f"median {kind:9s} {median:9.0f} tokens/s over {len(values)} runs of {args.steps} steps")


@dataclass
class PlainRunConfig:
    """A whole run of the hand-written loop: val loss per seed."""

    input: str
    """A text file, e.g. ../shared/data/tinyshakespeare.txt."""
    steps: int = 2000
    """Optimizer steps of each run."""
    seeds: list[int] = field(default_factory=lambda: [1337])
    """One run per seed."""


def bench_plain_run(args: PlainRunConfig) -> None:
    """The hand-written loop for a whole run, with the trainer's val loss at the end, per seed."""
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(args.input, str(data_dir), "char")
        for seed in args.seeds:
            model, times = plain_loop(data_dir, args.steps, seed)
            tokens_per_s = BATCH * SHAPE.block_size / statistics.median(times[10:])
            loss = whole_split_loss(model, data_dir)
            print(f"seed {seed}: val loss {loss:.4f}, {tokens_per_s:.0f} tokens/s", flush=True)


@dataclass
class ValNoiseConfig:
    """Spread of nanoGPT's 20-batch val estimate for a checkpoint."""

    ckpt: str
    """A checkpoint written by train.py."""
    data_dir: str
    """The prepared directory the run trained on."""
    draws: int = 100
    """Estimates drawn."""


def bench_val_noise(args: ValNoiseConfig) -> None:
    """How far nanoGPT's val estimate (mean loss of 20 random batches of 12 windows) strays from the
    loss over the whole validation split, for one checkpoint: the noise in a figure like 1.886."""
    ckpt = load_checkpoint(args.ckpt)
    data = load_prepared(args.data_dir)
    val = data.tokens("val")
    T = ckpt.model.config.block_size
    full_loss = whole_split_loss(ckpt.model, Path(args.data_dir))
    with torch.no_grad():
        rng = np.random.default_rng(0)
        estimates = []
        for _ in range(args.draws):
            batch_losses = []
            for _ in range(20):
                offsets = rng.integers(0, len(val) - T, size=BATCH)
                x = torch.from_numpy(np.stack([val[o : o + T] for o in offsets]).astype(np.int64))
                y = torch.from_numpy(np.stack([val[o + 1 : o + 1 + T] for o in offsets]).astype(np.int64))
                batch_losses.append(ckpt.model(x, y)[1].item())
            estimates.append(statistics.mean(batch_losses))
    print(f"whole val split: {full_loss:.4f}")
    print(
        f"20 random batches of {BATCH}: mean {statistics.mean(estimates):.4f}, "
        f"std {statistics.stdev(estimates):.4f}, min {min(estimates):.4f}, max {max(estimates):.4f} "
        f"over {args.draws} draws"
    )


TRAIN_STEP = Command("bench.py train-step", TrainStepConfig, bench_train_step, TrainStepConfig.__doc__, logs=False)
PLAIN_RUN = Command("bench.py plain-run", PlainRunConfig, bench_plain_run, PlainRunConfig.__doc__, logs=False)
VAL_NOISE = Command("bench.py val-noise", ValNoiseConfig, bench_val_noise, ValNoiseConfig.__doc__, logs=False)
