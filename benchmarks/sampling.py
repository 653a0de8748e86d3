"""Decode speed with and without the KV cache (`python bench.py sample`)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from core.cli import Command
from model import GPT, GPTConfig
from model.generation import context_window


@dataclass
class SampleBenchConfig:
    """Decode tokens/s with and without the KV cache, CPU."""

    tokens: int = 1000
    """New tokens per run."""
    runs: int = 4
    """2 (A B) or 4 (A B B A)."""
    pos_encoding: str = "rope"
    """The model's position scheme (learned slides its window past block_size 256)."""


def bench_sample(args: SampleBenchConfig) -> None:
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


SAMPLE = Command("bench.py sample", SampleBenchConfig, bench_sample, SampleBenchConfig.__doc__, logs=False)
