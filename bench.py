"""Benchmarks whose figures go into BENCHMARKS.md.

    python bench.py train-step --input ../shared/data/tinyshakespeare.txt [--steps 300 --rounds 2]
    python bench.py plain-run --input ../shared/data/tinyshakespeare.txt --seeds 1337 1 2
    python bench.py val-noise --ckpt runs/X/last.ckpt --data_dir prepared/Y
    python bench.py sample [--tokens 1000 --runs 4]
    python bench.py vs-nanogpt --peer ../shared/peers/nanoGPT --input ../shared/data/tinyshakespeare.txt --shape cpu
    python bench.py precision [--steps 20] [--profile 4,128,64,12]
    python bench.py clip [--steps 100]

`train-step` times optimizer steps of the default CPU shape (nanoGPT's CPU config, learned
positions) two ways, interleaved A B B A so that the machine's drift hits both alike:
  A: the Lightning trainer (`training.run.train`, as `python train.py` runs it);
  B: a hand-written PyTorch loop in the style of nanoGPT's train.py, on the same model, data and
     optimizer (np.memmap batches, forward, backward, clip, AdamW step).
It prints the median tokens/s of each. `plain-run` trains B for a whole run and reports the val
loss the trainer would log (every fixed window of the validation split), so the two can be
compared on loss as well as speed. `val-noise` measures how noisy nanoGPT's own val estimate is.

`vs-nanogpt` runs nanoGPT's own train.py (a scratch copy of the peer, outside the project) and our
train.py with default flags, as separate processes, at one shape, for two run lengths each, rounds
interleaved A B B A: the per-step cost is the difference of the wall times over the difference of
the step counts, so start-up, the evaluation and the final checkpoint cancel out. `precision` times
a training step (forward, backward, clip, fused AdamW) in float32 and under bf16 autocast over a
grid of model shapes on this CPU (the rule behind `training.hardware.resolve_precision`), then the
fused attention kernel alone in both dtypes; `--profile` prints where one shape's step goes. `clip`
times the optimizer phase (clipping + AdamW step) for the fused, foreach and single-tensor AdamW,
with and without clipping, under bf16 autocast.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.attention import ATTENTION_KINDS, VARIANTS, bench_attention_cost, bench_variants
from data.dataset import load_prepared
from data.prepare import prepare
from evaluation.checkpoint import load_checkpoint
from evaluation.extrapolation import evaluate_length
from model import GPT, GPTConfig
from model.generation import context_window
from training.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from training.module import lr_factor
from training.run import latest_metrics, train

SHAPE = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False, pos_encoding="learned")
BATCH = 12


def lightning_tokens_per_s(data_dir: Path, out: Path, steps: int) -> float:
    """Median of the trainer's own tokens/s readings (SpeedMonitor, every 25 steps, warm-up excluded)."""
    cfg = RunConfig(
        model=SHAPE,
        data=DataConfig(input=None, dir=str(data_dir)),
        optim=OptimConfig(beta2=0.99),
        train=TrainConfig(
            max_steps=steps,
            batch_size=BATCH,
            eval_interval=10**9,
            log_interval=25,
            out_dir=str(out),
            run_name="lightning",
            overwrite=True,  # each round starts afresh in the same directory
            progress_bar=False,
            sample_tokens=0,
        ),
    )
    result = train(cfg)
    rows = latest_metrics(result.run_dir).read_text().splitlines()
    header = rows[0].split(",")
    col = header.index("perf/tokens_per_s")
    values = [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]
    return statistics.median(values)


def plain_loop_tokens_per_s(data_dir: Path, steps: int) -> float:
    """nanoGPT-style loop; median over steps (the first 10 excluded as warm-up)."""
    _, times = plain_loop(data_dir, steps, seed=1337)
    return BATCH * SHAPE.block_size / statistics.median(times[10:])


def whole_split_loss(model: GPT, data_dir: Path) -> float:
    """Mean loss over every fixed window of the validation split (what the trainer logs as val/loss)."""
    val = load_prepared(data_dir).tokens("val")
    return evaluate_length(model, val, model.config.block_size, token_budget=len(val), batch_size=64).loss


def plain_loop(data_dir: Path, steps: int, seed: int) -> tuple[GPT, list[float]]:
    """Train SHAPE with a hand-written loop in the style of nanoGPT's train.py; return the model and
    the wall time of every step."""
    torch.manual_seed(seed)
    model = GPT(SHAPE)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99)
    )
    T = SHAPE.block_size
    times = []
    for step in range(steps):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * lr_factor(step, 1e-3, 1e-4, 100, steps)
        data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - T, (BATCH,))
        x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in ix])
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return model, times


def bench_plain_run(args: argparse.Namespace) -> None:
    """The hand-written loop for a whole run, with the trainer's val loss at the end, per seed."""
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(args.input, str(data_dir), "char")
        for seed in args.seeds:
            model, times = plain_loop(data_dir, args.steps, seed)
            tokens_per_s = BATCH * SHAPE.block_size / statistics.median(times[10:])
            loss = whole_split_loss(model, data_dir)
            print(f"seed {seed}: val loss {loss:.4f}, {tokens_per_s:.0f} tokens/s", flush=True)


def bench_train_step(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(args.input, str(data_dir), "char")
        results: dict[str, list[float]] = {"lightning": [], "plain": []}
        for _ in range(args.rounds):
            for kind in ("lightning", "plain", "plain", "lightning"):
                if kind == "lightning":
                    results[kind].append(lightning_tokens_per_s(data_dir, Path(tmp) / "runs", args.steps))
                else:
                    results[kind].append(plain_loop_tokens_per_s(data_dir, args.steps))
                print(f"{kind:9s} {results[kind][-1]:9.0f} tokens/s", flush=True)
    for kind, values in results.items():
        median = statistics.median(values)
        print(f"median {kind:9s} {median:9.0f} tokens/s over {len(values)} runs of {args.steps} steps")


def bench_val_noise(args: argparse.Namespace) -> None:
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


def bench_sample(args: argparse.Namespace) -> None:
    """Decode speed with and without the KV cache: a ~10M-parameter char model (nanoGPT's
    shakespeare_char GPU shape, random weights: speed does not depend on them; RoPE by default, whose
    window is 4 x 256 tokens), batch 1, one-token
    prompt, `--tokens` new tokens, runs interleaved A B B A."""
    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False)
    model = GPT(dataclasses.replace(shape, pos_encoding=args.pos_encoding)).eval()
    window = context_window(model)
    print(f"{model.num_params() / 1e6:.2f}M parameters, {args.pos_encoding}, window {window} tokens")
    prompt = torch.zeros(1, 1, dtype=torch.long)
    results: dict[bool, list[float]] = {True: [], False: []}
    for use_cache in [True, False, False, True][: args.runs]:
        start = time.perf_counter()
        model.generate(prompt, args.tokens, temperature=0, use_cache=use_cache)
        results[use_cache].append(args.tokens / (time.perf_counter() - start))
        print(f"{'kv cache' if use_cache else 'no cache'}: {results[use_cache][-1]:.1f} tokens/s", flush=True)
    cached, uncached = statistics.median(results[True]), statistics.median(results[False])
    print(f"median: kv cache {cached:.1f} tokens/s, no cache {uncached:.1f} tokens/s, {cached / uncached:.1f}x")


SHAPES = {
    # nanoGPT's README laptop command
    "cpu": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12},
    # its shakespeare_char recipe's model, at a CPU batch
    "6x384": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "batch_size": 8},
}
ROOT = Path(__file__).resolve().parent


def nanogpt_command(peer: Path, shape: dict[str, int], steps: int, out: Path) -> list[str]:
    """nanoGPT's laptop command at `shape`, evaluating only at step 0 and saving nothing."""
    flags = {**shape, "device": "cpu", "compile": False, "eval_iters": 20, "log_interval": 1, "dropout": 0.0,
             "max_iters": steps, "lr_decay_iters": steps, "eval_interval": 10**9, "out_dir": str(out)}  # fmt: skip
    return [sys.executable, "train.py", "config/train_shakespeare_char.py", *(f"--{k}={v}" for k, v in flags.items())]


def our_command(data_dir: Path, shape: dict[str, int], steps: int, out: Path, extra: list[str]) -> list[str]:
    """Our train.py with its default flags at `shape` (learned positions, as nanoGPT), one evaluation
    (at the end, 20 batches as nanoGPT's) and one checkpoint."""
    model = {k: shape[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    eval_tokens = 20 * shape["batch_size"] * shape["block_size"]
    args = [f"--model.{k}={v}" for k, v in model.items()] + [
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


def logged_step_ms(kind: str, stdout: str, run_dir: Path) -> float:
    """The median step time a run logged itself: nanoGPT prints each iteration's time (the first
    five left out: warm-up); ours logs tokens/s every log_interval steps (its first step left out)."""
    if kind == "nanoGPT":
        times = [float(line.split("time ")[1].split("ms")[0]) for line in stdout.splitlines() if "time " in line]
        return statistics.median(times[5:])
    rows = latest_metrics(run_dir).read_text().splitlines()
    col = rows[0].split(",").index("perf/tokens_per_s")
    speeds = [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]
    tokens = int(run_dir.name.split("-")[1])  # bench-<tokens per step>-<steps>
    return 1000 * tokens / statistics.median(speeds)


def bench_vs_nanogpt(args: argparse.Namespace) -> None:
    shape = SHAPES[args.shape]
    short, long = args.steps
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "nanoGPT"
        shutil.copytree(args.peer, peer)  # a scratch copy: the peer is run, never imported or copied in
        data = peer / "data" / "shakespeare_char"
        shutil.copy(args.input, data / "input.txt")
        subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
        ours_data = Path(tmp) / "ours-data"
        prepare(args.input, str(ours_data), "char")
        commands = {
            "nanoGPT": lambda n: (nanogpt_command(peer, shape, n, Path(tmp) / f"nano-{n}"), peer),
            "ours": lambda n: (our_command(ours_data, shape, n, Path(tmp) / "runs", args.ours_args), ROOT),
        }
        per_step: dict[str, list[float]] = {"ours": [], "nanoGPT": []}
        logged: dict[str, list[float]] = {"ours": [], "nanoGPT": []}
        for _ in range(args.rounds):
            for kind in ("ours", "nanoGPT", "nanoGPT", "ours"):
                runs = {n: timed_run(*commands[kind](n)) for n in (short, long)}
                per_step[kind].append((runs[long][0] - runs[short][0]) / (long - short))
                run_dir = Path(tmp) / "runs" / f"bench-{shape['batch_size'] * shape['block_size']}-{long}"
                logged[kind].append(logged_step_ms(kind, runs[long][1], run_dir))
                print(
                    f"{kind:8s} {short} steps {runs[short][0]:6.1f} s, {long} steps {runs[long][0]:6.1f} s: "
                    f"{1000 * per_step[kind][-1]:.1f} ms/step (its own log: {logged[kind][-1]:.1f})",
                    flush=True,
                )
    ours, nano = statistics.median(per_step["ours"]), statistics.median(per_step["nanoGPT"])
    tokens = shape["batch_size"] * shape["block_size"]
    print(f"shape {args.shape} {shape}, ours {' '.join(args.ours_args)}")
    print(
        f"median ms/step from the two lengths: ours {1000 * ours:.1f} ({tokens / ours:,.0f} tokens/s), nanoGPT "
        f"{1000 * nano:.1f} ({tokens / nano:,.0f} tokens/s): ours {nano / ours:.2f}x nanoGPT's tokens/s"
    )
    ours_log, nano_log = statistics.median(logged["ours"]), statistics.median(logged["nanoGPT"])
    print(
        f"median ms/step from the runs' own logs: ours {ours_log:.1f}, nanoGPT {nano_log:.1f}: "
        f"ours {nano_log / ours_log:.2f}x"
    )


def _step_runner(layers: int, width: int, block: int, batch: int, optimizer_kwargs: dict | None = None):
    """A training step of a `layers` x `width` learned-position GPT on one fixed batch: forward
    (optionally under bf16 autocast), backward, clipping (optional), AdamW (fused by default)."""
    config = GPTConfig(vocab_size=65, block_size=block, n_layer=layers, n_head=4 if width <= 256 else 6,
                       n_embd=width, bias=False, pos_encoding="learned")  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **(optimizer_kwargs or {"fused": True}))
    x = torch.randint(0, 65, (batch, block))

    def step(bf16: bool, clip: bool = True) -> tuple[float, float]:
        """Wall seconds of the whole step and of its optimizer phase."""
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            _, loss = model(x, x)
        loss.backward()
        middle = time.perf_counter()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return end - start, end - middle

    return step


def bench_precision(args: argparse.Namespace) -> None:
    """ms per training step, float32 against bf16 autocast, per shape, A B B A; then SDPA alone."""
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        step = _step_runner(*args.profile)
        for _ in range(5):
            step(args.profile_bf16)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step(args.profile_bf16)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return
    print(f"{'shape':>24s} {'float32 ms':>11s} {'bf16 ms':>9s} {'bf16 speed-up':>14s}")
    for layers, width, block, batch in args.grid:
        step = _step_runner(layers, width, block, batch)
        times: dict[bool, list[float]] = {False: [], True: []}
        for bf16 in (False, True, True, False):
            for i in range(args.steps + 3):
                elapsed = step(bf16)[0]
                if i >= 3:  # warm-up excluded
                    times[bf16].append(elapsed)
        fp32, bf16 = (1000 * statistics.median(times[k]) for k in (False, True))
        name = f"{layers}x{width}, T={block}, B={batch}"
        print(f"{name:>24s} {fp32:11.1f} {bf16:9.1f} {fp32 / bf16:13.2f}x", flush=True)
    print(f"\n{'SDPA fwd+bwd (B, H, T, D)':>28s} {'float32 ms':>11s} {'bf16 ms':>9s}")
    for shape in ((12, 4, 64, 32), (12, 4, 256, 32), (8, 6, 256, 64), (12, 6, 64, 64), (4, 12, 1024, 64)):
        fp32, bf16 = (statistics.median(_sdpa_times(shape, d, args.steps)) for d in (torch.float32, torch.bfloat16))
        print(f"{str(shape):>28s} {1000 * fp32:11.2f} {1000 * bf16:9.2f}", flush=True)


def _sdpa_times(shape: tuple[int, ...], dtype: torch.dtype, steps: int) -> list[float]:
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(*shape, dtype=dtype)
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return times


def bench_clip(args: argparse.Namespace) -> None:
    """The optimizer phase (clip + AdamW step + zero_grad) under bf16 autocast, variants interleaved
    step by step, for nanoGPT's CPU shape and the 6x384 shape."""
    variants = {
        "fused AdamW + clip": ({"fused": True}, True),
        "foreach AdamW + clip": ({"foreach": True}, True),
        "single-tensor AdamW + clip": ({"foreach": False}, True),
        "fused AdamW, no clip": ({"fused": True}, False),
    }
    for shape, steps in (((4, 128, 64, 12), args.steps), ((6, 384, 256, 8), max(5, args.steps // 10))):
        runners = {name: _step_runner(*shape, kwargs) for name, (kwargs, _) in variants.items()}
        phase: dict[str, list[float]] = {name: [] for name in variants}
        whole: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(steps + 3):
            for name, run in runners.items():
                total, optimizer_part = run(True, clip=variants[name][1])
                if i >= 3:
                    whole[name].append(total)
                    phase[name].append(optimizer_part)
        print(f"shape {shape[0]}x{shape[1]}, T={shape[2]}, B={shape[3]}, bf16 autocast, {steps} steps each")
        for name in variants:
            print(f"  {name:28s} optimizer phase {1000 * statistics.median(phase[name]):6.2f} ms, "
                  f"whole step {1000 * statistics.median(whole[name]):7.1f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    step = sub.add_parser("train-step", help="Lightning trainer vs a hand-written loop, tokens/s on CPU")
    step.add_argument("--input", required=True, help="a text file, e.g. ../shared/data/tinyshakespeare.txt")
    step.add_argument("--steps", type=int, default=300)
    step.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    plain = sub.add_parser("plain-run", help="a whole run of the hand-written loop: val loss per seed")
    plain.add_argument("--input", required=True)
    plain.add_argument("--steps", type=int, default=2000)
    plain.add_argument("--seeds", type=int, nargs="+", default=[1337])
    noise = sub.add_parser("val-noise", help="spread of nanoGPT's 20-batch val estimate for a checkpoint")
    noise.add_argument("--ckpt", required=True)
    noise.add_argument("--data_dir", required=True, help="the prepared directory the run trained on")
    noise.add_argument("--draws", type=int, default=100)
    decode = sub.add_parser("sample", help="decode tokens/s with and without the KV cache, CPU")
    decode.add_argument("--tokens", type=int, default=1000)
    decode.add_argument("--runs", type=int, default=4, help="2 (A B) or 4 (A B B A)")
    decode.add_argument("--pos_encoding", default="rope", help="learned slides its window past block_size 256")
    versus = sub.add_parser("vs-nanogpt", help="our train.py against nanoGPT's, per-step cost, CPU")
    versus.add_argument("--peer", required=True, help="nanoGPT's directory (copied to a scratch directory)")
    versus.add_argument("--input", required=True)
    versus.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    versus.add_argument("--steps", type=int, nargs=2, default=[50, 250], help="the two run lengths")
    versus.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    versus.add_argument("--ours_args", nargs="*", default=[], help="extra flags for our train.py")
    prec = sub.add_parser("precision", help="float32 against bf16 autocast, ms per training step, CPU")
    prec.add_argument("--steps", type=int, default=20)
    prec.add_argument(
        "--profile",
        type=lambda s: tuple(map(int, s.split(","))),
        default=None,
        help="layers,width,block,batch: print the profiler's table of one shape instead",
    )
    prec.add_argument("--profile_bf16", action="store_true", help="profile under bf16 autocast")
    prec.add_argument("--grid", type=lambda s: tuple(map(int, s.split(","))), nargs="+",
                      default=[(4, 128, 64, 12), (4, 128, 256, 12), (4, 192, 64, 12), (4, 256, 64, 12),
                               (4, 256, 256, 8), (6, 384, 64, 12), (6, 384, 256, 8)],
                      help="layers,width,block,batch ...")  # fmt: skip
    clip = sub.add_parser("clip", help="the optimizer phase with and without clipping, fused or not, CPU")
    clip.add_argument("--steps", type=int, default=100)
    cost = sub.add_parser("attention-cost", help="fwd+bwd time and peak memory of attention kinds against T, CPU")
    cost.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    cost.add_argument("--kinds", nargs="+", choices=ATTENTION_KINDS, default=list(ATTENTION_KINDS))
    cost.add_argument("--eager_max", type=int, default=4096, help="longest T for the T x T eager reference")
    variants = sub.add_parser("variants", help="training step of each attention variant, interleaved, CPU")
    variants.add_argument("--shape", type=lambda t: tuple(map(int, t.split(","))), default=(4, 128, 256, 8),
                          help="layers,width,block,batch")  # fmt: skip
    variants.add_argument("--steps", type=int, default=10)
    variants.add_argument("--rounds", type=int, default=4)
    variants.add_argument("--names", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                          help="the variants to time (the first is the reference)")  # fmt: skip
    args = parser.parse_args()
    commands = {
        "train-step": bench_train_step,
        "plain-run": bench_plain_run,
        "val-noise": bench_val_noise,
        "sample": bench_sample,
        "vs-nanogpt": bench_vs_nanogpt,
        "precision": bench_precision,
        "clip": bench_clip,
        "attention-cost": bench_attention_cost,
        "variants": bench_variants,
    }
    commands[args.bench](args)


if __name__ == "__main__":
    main()
