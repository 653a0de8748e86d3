"""Where a CPU training step's time goes (`python bench.py precision | clip`).

`precision` times a training step (forward, backward, clip, fused AdamW) in float32 and under bf16
autocast over a grid of model shapes on this CPU (the rule behind
`training.hardware.resolve_precision`), then the fused attention kernel alone in both dtypes;
`--profile` prints where one shape's step goes. `clip` times the optimizer phase (clipping + AdamW
step) for the fused, foreach and single-tensor AdamW, with and without clipping, under bf16 autocast.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from core.cli import Command
from model import GPT, GPTConfig

Shape = tuple[int, int, int, int]
"""layers, width, block, batch."""


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


@dataclass
class PrecisionConfig:
    """float32 against bf16 autocast, ms per training step, CPU."""

    steps: int = 20
    """Timed steps per shape and dtype (profiled steps with --profile)."""
    profile: Shape | None = None
    """layers width block batch: print the profiler's table of one shape instead."""
    profile_bf16: bool = False
    """Profile under bf16 autocast."""
    grid: list[Shape] = field(default_factory=lambda: [(4, 128, 64, 12), (4, 128, 256, 12), (4, 192, 64, 12),
                                                       (4, 256, 64, 12), (4, 256, 256, 8), (6, 384, 64, 12),
                                                       (6, 384, 256, 8)])  # fmt: skip
    """The shapes timed: [layers,width,block,batch] ..."""


def bench_precision(args: PrecisionConfig) -> None:
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


@dataclass
class ClipConfig:
    """The optimizer phase with and without clipping, fused or not, CPU."""

    steps: int = 100
    """Timed steps at the small shape (a tenth, at least 5, at the 6x384 shape)."""


def bench_clip(args: ClipConfig) -> None:
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


PRECISION = Command("bench.py precision", PrecisionConfig, bench_precision, PrecisionConfig.__doc__, logs=False)
CLIP = Command("bench.py clip", ClipConfig, bench_clip, ClipConfig.__doc__, logs=False)
