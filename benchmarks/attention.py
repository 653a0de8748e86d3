"""The training step of each attention variant on a CPU, interleaved (`python bench.py variants`).
Figures go into BENCHMARKS.md."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.cli import Command
from core.errors import ConfigError
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


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


VARIANT_STEP = Command("bench.py variants", VariantsConfig, bench_variants, VariantsConfig.__doc__, logs=False)
