"""Training speed per position scheme and shape, against nanoGPT's step and through the Lightning
trainer (`python bench.py gpu`).

Each row trains a freshly built model (seeded random weights) on random tokens for `--warmup`
steps, then times `--steps` more. A step is what `train.py` runs: forward (bf16 autocast on a GPU,
float32 on a CPU), backward, clipping of the global gradient norm, fused AdamW, with a new batch
copied from pinned host memory each step. Three kinds of row:

- posgpt: our GPT with the scheme on the kernel `attn_backend=auto` picks for it (the `kernel`
  column), compiled as `train.py --train.compile true` compiles it;
- lightning: the same model and step through `training.run.train` (the trainer's own
  tokens/s over the last `--steps` steps: its whole per-step cost, logging and callbacks included);
- nanoGPT: the peer's GPT (learned positions, its `configure_optimizers`, `torch.compile`) on the
  same shape, imported from `../shared/peers/nanoGPT` (never copied), skipped with a note where
  absent.

What a row reports:
- ms/step and tokens/s: wall time of the timed steps over their count (device synchronized at both
  ends; nothing synchronizes inside);
- MFU: the model's own FLOPs per token (`GPT.flops_per_token`: 6N + 12 L C T, a window's T being
  the keys it keeps) times tokens/s over the device's dense bf16 peak (`training.hardware`); on a
  CPU none;
- peak memory: CUDA's max allocated bytes over the timed steps (weights, gradients, optimizer
  moments, activations), or on a CPU the process's peak resident set;
- compile s: the warm-up's wall time less `--warmup` timed steps, i.e. what compiling cost.

Every row is appended to `--json` as it finishes, so a GPU table can be gathered in commands of at
most 10 minutes (say, `--shapes 16x1024 32x1024`, then `--shapes 4x4096`, each with `--json
rows.jsonl`). A row that runs out of memory or fails is recorded with the reason, and the others go
on. On a CPU the command runs a tiny model at a small shape: the test suite runs it, so that it
never rots.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DEFAULT_PEER, append_json, device_name, load_peer
from benchmarks.gpu_rows import (
    MODELS,
    GpuBenchConfig,
    Row,
    Setup,
    resolve,
    run_lightning,
    run_nanogpt,
    run_ours,
)
from core.cli import Command


def guarded(setup: Setup, label: Row, run: Callable[[], Row]) -> Row:
    """The row `run` measures, or `label` with the reason it could not (out of memory, an error:
    its traceback on stderr), so that one failing row does not end a table being gathered."""
    try:
        return run()
    except torch.OutOfMemoryError:
        note = "out of memory"
    except Exception as error:  # noqa: BLE001 - a benchmark table records the failure and goes on
        traceback.print_exc()
        note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    finally:
        if setup.cuda:
            torch.cuda.empty_cache()
    return dataclasses.replace(label, note=note)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEAD = ["model", "scheme", "kernel", "B x T", "ms/step", "tokens/s", "MFU", "peak GiB", "compile s", "note"]


def row_line(row: Row) -> str:
    cells = [row.model, row.scheme, row.kernel, f"{row.batch} x {row.context}", _cell(row.ms_per_step, ".1f"),
             _cell(row.tokens_per_s, ",.0f"), _cell(None if row.mfu is None else 100 * row.mfu, ".1f"),
             _cell(None if row.peak_mib is None else row.peak_mib / 1024, ".2f"), _cell(row.compile_s, ".1f"),
             row.note]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def record(setup: Setup, row: Row) -> None:
    print(row_line(row), flush=True)
    a = setup.args
    append_json(a.json, {"device": device_name(setup.device), "precision": setup.precision, "shape": setup.model,
                         **MODELS[setup.model], **dataclasses.asdict(row), "compile": a.compile,
                         "compile_mode": a.compile_mode, "sdpa_backend": a.sdpa_backend, "chunked_loss": a.chunked_loss,
                         "activation_checkpointing": a.activation_checkpointing, "fp8": a.fp8, "steps": setup.steps,
                         "warmup": a.warmup, "memory": setup.memory.label})  # fmt: skip


def ratios(rows: list[Row]) -> list[str]:
    """Per shape: each scheme against RoPE, the trainer against the bare step, ours against nanoGPT."""
    lines = []
    for batch, context in dict.fromkeys((r.batch, r.context) for r in rows):
        at = {(r.model, r.scheme): r.tokens_per_s for r in rows if (r.batch, r.context) == (batch, context)}
        parts = []
        rope = at.get(("posgpt", "rope"))
        for (kind, scheme), speed in at.items():
            if kind == "posgpt" and scheme != "rope" and rope and speed:
                parts.append(f"{scheme}/rope {speed / rope:.2f}")
            if kind == "lightning" and speed and at.get(("posgpt", scheme)):
                parts.append(f"trainer/bare ({scheme}) {speed / at['posgpt', scheme]:.3f}")
        nano = at.get(("nanoGPT", "learned"))
        for scheme in ("learned", "rope"):
            if nano and at.get(("posgpt", scheme)):
                parts.append(f"{scheme}/nanoGPT {at['posgpt', scheme] / nano:.2f}")
        lines.append(f"{batch} x {context}: " + (", ".join(parts) or "-"))
    return lines


def planned_rows(setup: Setup, peer: Any) -> list[tuple[Row, Callable[[], Row]]]:
    """Every row of the table, shape by shape: ours per scheme, the trainer's, nanoGPT's; each as
    its label (what a failed row shows) and the call that measures it."""
    planned: list[tuple[Row, Callable[[], Row]]] = []
    for batch, context in setup.shapes:
        for scheme in setup.args.schemes:
            run = functools.partial(run_ours, setup, scheme, batch, context)
            planned.append((Row("posgpt", scheme, "", batch, context), run))
        for scheme in setup.args.trainer:
            run = functools.partial(run_lightning, setup, scheme, batch, context)
            planned.append((Row("lightning", scheme, "", batch, context), run))
        if peer is not None:
            run = functools.partial(run_nanogpt, setup, peer, batch, context)
            planned.append((Row("nanoGPT", "learned", "sdpa", batch, context), run))
    return planned


def bench_gpu(args: GpuBenchConfig) -> None:
    setup = resolve(args)
    peer_dir = DEFAULT_PEER if args.peer is None else Path(args.peer)
    peer = None if args.peer == "none" else load_peer(peer_dir)
    print(f"{device_name(setup.device)}, {setup.precision}, torch {torch.__version__}; model {setup.model} "
          f"{MODELS[setup.model]}, no biases; {args.warmup} warm-up + {setup.steps} timed steps; compile "
          f"{args.compile} ({args.compile_mode}), SDPA backend {args.sdpa_backend}, chunked loss {args.chunked_loss}, "
          f"activation checkpointing {args.activation_checkpointing}, fp8 {args.fp8}; window row: RoPE, window "
          f"{args.window}, {args.sinks} sinks; peak memory: {setup.memory.how}")  # fmt: skip
    if peer is None and args.peer != "none":
        print(f"note: no nanoGPT model.py in {peer_dir}: its rows are skipped (--peer DIR to give it)")
    print("| " + " | ".join(HEAD) + " |\n" + "|" + "---|" * len(HEAD), flush=True)
    rows: list[Row] = []
    for label, run in planned_rows(setup, peer):
        rows.append(guarded(setup, label, run))
        record(setup, rows[-1])
    print("\n" + "\n".join(ratios(rows)))
    switches = [name for name in ("chunked_loss", "activation_checkpointing", "fp8") if getattr(args, name)]
    if switches and peer is not None:
        print(f"note: our rows ran with {', '.join(switches)}, nanoGPT's without: its ratios compare unlike steps")


GPU = Command("bench.py gpu", GpuBenchConfig, bench_gpu, GpuBenchConfig.__doc__, logs=False)
