"""Attention benchmarks (issue 11), run through `python bench.py attention-cost | variants`:
time and memory of softmax, linear and window attention against the length, and the training step
of each attention variant. Figures go into BENCHMARKS.md."""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import torch

from core.cli import Command
from core.errors import ConfigError
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


AttentionKind = Literal["softmax-sdpa", "softmax-eager", "linear-chunked", "window-sdpa"]
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)


def attention_cost(kind: str, T: int, heads: int = 4, head_dim: int = 32, repeats: int = 3) -> tuple[float, float]:
    """Forward + backward of one attention call on (1, heads, T, head_dim) inputs in float32, in
    this process: (median ms, peak resident MiB above what the imports took)."""
    import resource

    from model.attention.linear import feature_map, linear_attention_chunked
    from model.kernels import causal_mask, eager_attention, sdpa_attention
    from model.masks import AttentionMask

    baseline_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # imports, before any tensor
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, T, head_dim, requires_grad=True) for _ in range(3))
    window = AttentionMask(window=256).dense(torch.arange(T), torch.arange(T)) if kind == "window-sdpa" else None

    def step() -> None:
        if kind == "softmax-sdpa":
            out = sdpa_attention(q, k, v)
        elif kind == "softmax-eager":
            out = eager_attention(q, k, v, mask=causal_mask(T, T))
        elif kind == "window-sdpa":
            out = sdpa_attention(q, k, v, mask=window)
        else:
            fq, fk = feature_map(q), feature_map(k)
            out = linear_attention_chunked(torch.cat([fq, fq], -1), torch.cat([fk, fk], -1), v)[0]
        out.sum().backward()

    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mib
    return 1000 * statistics.median(times[1:]), peak_mib


@dataclass
class AttentionCostConfig:
    """fwd+bwd time and peak memory of attention kinds against T, CPU."""

    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    """Sequence lengths T."""
    kinds: list[AttentionKind] = field(default_factory=lambda: list(ATTENTION_KINDS))
    """The attention kinds timed."""
    eager_max: int = 4096
    """Longest T for the T x T eager reference."""


def bench_attention_cost(args: AttentionCostConfig) -> None:
    """Each (kind, T) in a fresh process, so that its peak resident memory is its own."""
    print("| kind | T | fwd+bwd ms | peak MiB above the imports |\n|---|---|---|---|")
    for T in args.lengths:
        for kind in args.kinds:
            if kind == "softmax-eager" and T > args.eager_max:
                print(f"| {kind} | {T} | skipped: its T x T float32 scores and gradients need > 10 GiB | |")
                continue
            code = f"from benchmarks.attention import attention_cost; print(*attention_cost({kind!r}, {T}))"
            out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
            ms, mib = map(float, out.stdout.split())
            print(f"| {kind} | {T} | {ms:.1f} | {mib:.0f} |", flush=True)


VARIANTS: dict[str, dict[str, object]] = {
    "rope": {"pos_encoding": "rope"},
    "learned": {"pos_encoding": "learned"},
    "sinusoidal": {"pos_encoding": "sinusoidal"},
    "none": {"pos_encoding": "none"},
    "alibi": {"pos_encoding": "alibi"},
    "t5": {"pos_encoding": "t5"},
    "kerple": {"pos_encoding": "kerple"},
    "fire": {"pos_encoding": "fire"},
    "rope-window64": {"pos_encoding": "rope", "attn_window": 64},
    "rope-window64-sinks4": {"pos_encoding": "rope", "attn_window": 64, "attn_sinks": 4},
    "rope-linear": {"pos_encoding": "rope", "attention": "linear"},
    "rope-dot": {"pos_encoding": "rope", "attn_score": "dot"},
    "rope-general": {"pos_encoding": "rope", "attn_score": "general"},
    "p-rope-0.5": {"pos_encoding": "rope", "rope_fraction": 0.5},
    "neox-rope-0.5": {"pos_encoding": "rope", "rope_fraction": 0.5, "rope_partial": "neox"},
    "rope-logn": {"pos_encoding": "rope", "attn_log_scaling": "learned"},
    "none-logn": {"pos_encoding": "none", "attn_log_scaling": "learned"},
    "rope-sigmoid": {"pos_encoding": "rope", "attention": "sigmoid"},
    "rope-differential": {"pos_encoding": "rope", "attention": "differential"},
    "rope-bigbird": {
        "pos_encoding": "rope",
        "attn_window": 64,
        "attn_sinks": 4,
        "attn_random_blocks": 2,
        "attn_sparse_block": 32,
    },
    "rope-additive": {"pos_encoding": "rope", "attn_score": "additive"},
}


@dataclass
class VariantsConfig:
    """Training step of each attention variant, interleaved, CPU."""

    shape: tuple[int, int, int, int] = (4, 128, 256, 8)
    """layers width block batch."""
    steps: int = 10
    """Timed steps per variant and round (2 more for warm-up)."""
    rounds: int = 4
    """Interleaved rounds."""
    names: list[str] = field(default_factory=lambda: list(VARIANTS))
    """The variants to time (the first is the reference)."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.names if name not in VARIANTS]
        if unknown:
            raise ConfigError(f"--names: no variant {unknown[0]!r}; choose among {', '.join(VARIANTS)}.")


def bench_variants(args: VariantsConfig) -> None:
    """Training step (forward, backward, AdamW) of each attention variant at one shape, float32, in
    interleaved rounds (every variant once per round, the order reversed every other round)."""
    layers, width, block, batch = args.shape
    base = GPTConfig(vocab_size=65, block_size=block, n_layer=layers, n_head=4, n_embd=width, bias=False)
    models = {}
    for name in args.names:
        extra = VARIANTS[name]
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(base, **extra))
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    idx = torch.randint(0, 65, (batch, block + 1))
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            model, optimizer = models[name]
            for i in range(args.steps + 2):
                start = time.perf_counter()
                _, loss = model(idx[:, :-1], idx[:, 1:])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if i >= 2:  # warm-up left out
                    times[name].append(time.perf_counter() - start)
    default = statistics.median(times[names[0]])
    print(f"shape {args.shape} (layers, width, block, batch), float32, {args.rounds} rounds x {args.steps} steps")
    print("| variant | ms/step (median) | tokens/s | vs default |\n|---|---|---|---|")
    for name in names:
        ms = 1000 * statistics.median(times[name])
        print(f"| {name} | {ms:.1f} | {batch * block / ms * 1000:,.0f} | {default * 1000 / ms:.2f}x |")


ATTENTION_COST = Command(
    "bench.py attention-cost", AttentionCostConfig, bench_attention_cost, AttentionCostConfig.__doc__, logs=False
)
VARIANT_STEP = Command("bench.py variants", VariantsConfig, bench_variants, VariantsConfig.__doc__, logs=False)
