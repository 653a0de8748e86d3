"""Training memory of every scheme and attention function against RoPE's, counted rather than sampled: the bytes of
the distinct storages autograd keeps for the backward pass of one step (`saved_tensors_hooks`), at issue 50's probe
shape (4 layers, 256 wide, 8 heads, vocabulary 256, batch 2, float32). `python bench.py memory`; with `--resident
true`, what a user sees instead: the peak resident set's growth over one forward and backward pass (`ru_maxrss`), in
a fresh process with one thread, the baseline read once the model is built (issue 62's protocol)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from posgpt.core.cli import Command
from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig

PROBE = GPTConfig(vocab_size=256, block_size=2048, n_layer=4, n_head=8, n_embd=256, bias=False)


def variants(base: GPTConfig) -> dict[str, GPTConfig]:
    """Every scheme with softmax attention, every function with RoPE (stick-breaking, GDN, KDA: none, their papers'),
    the layer's soft-cap and sink logits (the eager kernel on a CPU); those `base` cannot run left out."""
    fields = {s: {"pos_encoding": s} for s in SCHEMES}
    nope = ("stick_breaking", "gated_deltanet", "kda")
    fields |= {f: {"attention": f, "pos_encoding": "none" if f in nope else "rope"} for f in ATTENTIONS}
    fields |= {"softcap": {"pos_encoding": "rope", "attn_softcap": 30.0},
               "sinks": {"pos_encoding": "rope", "attn_sink_logits": True}}  # fmt: skip
    out = {}
    for name, extra in fields.items():
        with contextlib.suppress(ConfigError):
            out[name] = dataclasses.replace(base, **extra)
    return out


def saved_bytes(config: GPTConfig, batch: int, length: int) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of one training forward of `config`."""
    torch.manual_seed(0)
    model, idx = GPT(config), torch.randint(0, config.vocab_size, (batch, length))
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(idx, idx)
    return sum(kept.values())


RESIDENT_RUNS = 3
"""Fresh processes a resident cell runs in; it reports their largest growth (the allocator's choices vary)."""


def resident_growth(config: dict, batch: int, length: int) -> int:
    """Bytes the peak resident set of this process grows by over one training forward and backward of a model of
    `config` (a `GPTConfig.to_dict`), read after the model is built and before anything runs (Linux: KiB)."""
    torch.manual_seed(0)
    model, idx = GPT(GPTConfig.from_dict(config)), torch.randint(0, config["vocab_size"], (batch, length))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model(idx, idx)[1].backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def resident_bytes(config: GPTConfig, batch: int, length: int) -> int:
    """The largest `resident_growth` of `RESIDENT_RUNS` fresh processes, one thread each, the allocator as it is."""
    code = ("import json, sys, torch; torch.set_num_threads(1); from posgpt.benchmarks.memory import resident_growth; "
            "print(resident_growth(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))")  # fmt: skip
    argv = [sys.executable, "-c", code, json.dumps(config.to_dict()), str(batch), str(length)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run(argv, env=env, capture_output=True, text=True, check=True) for _ in range(RESIDENT_RUNS)]
    return max(int(run.stdout.split()[-1]) for run in runs)


@dataclass
class MemoryConfig:
    """Saved-tensor bytes of a training step per scheme, against RoPE's, at the probe shape."""

    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    """Context lengths T (batch 2)."""
    rows: list[str] | None = None
    """Which rows (a scheme, a function, softcap, sinks; default: all)."""
    resident: bool = False
    """The peak resident set's growth over a training step instead (`resident_bytes`: a fresh process per cell, three
    times, the largest), the rows' own float32 step on the CPU."""


def main(cfg: MemoryConfig) -> None:
    rows, measure = variants(PROBE), resident_bytes if cfg.resident else saved_bytes
    print("| row | " + " | ".join(f"T = {n}: MiB | vs RoPE" for n in cfg.lengths) + " |", flush=True)
    print("|---|" + "---:|---:|" * len(cfg.lengths), flush=True)
    rope = {n: measure(rows["rope"], 2, n) for n in cfg.lengths}
    for name in cfg.rows or rows:
        cells = [f"{(b := measure(rows[name], 2, n)) / 2**20:,.0f} | {b / rope[n]:.2f}x" for n in cfg.lengths]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


COMMAND = Command("bench.py memory", MemoryConfig, main, "Training memory per scheme against RoPE's, counted.")
