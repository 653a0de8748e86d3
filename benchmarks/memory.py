"""Training memory of every scheme and attention function against RoPE's, counted rather than sampled: the bytes of
the distinct storages autograd keeps for the backward pass of one step (`saved_tensors_hooks`), at issue 50's probe
shape (4 layers, 256 wide, 8 heads, vocabulary 256, batch 2, float32). `python bench.py memory`."""

from __future__ import annotations

import contextlib
import dataclasses
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


@dataclass
class MemoryConfig:
    """Saved-tensor bytes of a training step per scheme, against RoPE's, at the probe shape."""

    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    """Context lengths T (batch 2)."""
    rows: list[str] | None = None
    """Which rows (a scheme, a function, softcap, sinks; default: all)."""


def main(cfg: MemoryConfig) -> None:
    rows = variants(PROBE)
    print("| row | " + " | ".join(f"T = {n}: MiB | vs RoPE" for n in cfg.lengths) + " |")
    print("|---|" + "---:|---:|" * len(cfg.lengths))
    rope = {n: saved_bytes(rows["rope"], 2, n) for n in cfg.lengths}
    for name in cfg.rows or rows:
        cells = [f"{(b := saved_bytes(rows[name], 2, n)) / 2**20:,.0f} | {b / rope[n]:.2f}x" for n in cfg.lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")


COMMAND = Command("bench.py memory", MemoryConfig, main, "Training memory per scheme against RoPE's, counted.")
