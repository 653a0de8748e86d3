"""One attention call's forward and backward against the length T (`python bench.py attention-cost`): each function on
the kernel `auto` gives it on a CPU (softmax: SDPA, causal; linear: chunked; the delta rules: chunked, recomputed in
the backward as the model runs them), on (1, H, T, D) float32 inputs; the median of `--repeats` timed calls after
one untimed call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from posgpt.benchmarks.common import SEED, check_at_least, check_schemes
from posgpt.core.cli import Command
from posgpt.model.attention.delta import DeltaChunked
from posgpt.model.attention.linear import feature_map, linear_attention_chunked

FUNCTIONS = ("softmax", "linear", "gated_deltanet", "kda")


def attention_call(function: str, B: int, H: int, T: int, D: int) -> Callable[[], None]:
    """One forward and backward of `function` on fresh random inputs that take gradients."""
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(B, H, T, D, generator=gen).requires_grad_() for _ in range(3))
    decays = {"gated_deltanet": 1, "kda": D}  # log decays per head or per key channel
    beta = torch.rand(B, H, T, generator=gen).requires_grad_()
    g = (-torch.rand(B, H, T, decays.get(function, 1), generator=gen)).requires_grad_()

    def run() -> None:
        if function == "softmax":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif function == "linear":  # the layer's inputs: [rotated features, features], here unrotated
            fq, fk = feature_map(q), feature_map(k)
            out = linear_attention_chunked(torch.cat([fq, fq], -1), torch.cat([fk, fk], -1), v)[0]
        else:
            out = DeltaChunked.rule(F.normalize(q, dim=-1) / D**0.5, F.normalize(k, dim=-1), v, beta, g)[0]
        out.sum().backward()

    return run


@dataclass
class AttentionCostConfig:
    """One attention call's forward and backward against T, on this CPU, per attention function."""

    functions: list[str] = field(default_factory=lambda: list(FUNCTIONS))
    """Attention functions: softmax (SDPA), linear, gated_deltanet, kda (their chunked kernels)."""
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    """Lengths T."""
    heads: int = 4
    head_dim: int = 32
    repeats: int = 3
    """Timed calls per cell (the median is shown)."""

    def __post_init__(self) -> None:
        check_schemes(self.functions, FUNCTIONS, "--functions: ")
        check_at_least(1, heads=self.heads, head_dim=self.head_dim, repeats=self.repeats, lengths=min(self.lengths))


def median_ms(run: Callable[[], None], repeats: int) -> float:
    run()  # untimed: first-call allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(cfg: AttentionCostConfig) -> None:
    print(f"(1, {cfg.heads}, T, {cfg.head_dim}) float32, forward + backward, ms (median of {cfg.repeats}), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")  # fmt: skip
    print("| function | " + " | ".join(f"T = {n}" for n in cfg.lengths) + " | vs linear |")
    print("|---|" + "---:|" * (len(cfg.lengths) + 1))
    times = {f: [median_ms(attention_call(f, 1, cfg.heads, n, cfg.head_dim), cfg.repeats) for n in cfg.lengths]
             for f in cfg.functions}  # fmt: skip
    for function, row in times.items():
        ratio = [f"{a / b:.2f}" for a, b in zip(row, times["linear"], strict=True)] if "linear" in times else ["-"]
        print(f"| {function} | " + " | ".join(f"{ms:,.1f}" for ms in row) + f" | {' / '.join(ratio)} |")


COMMAND = Command(
    "bench.py attention-cost", AttentionCostConfig, main, "One attention call's forward and backward against T, CPU."
)
