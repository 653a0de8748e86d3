"""Training speed per position scheme and shape, against nanoGPT's step and through the Lightning trainer
(`python bench.py gpu`). Rows: posgpt (our GPT in train.py's step, on random tokens), lightning (the same through
`training.run.train`: the trainer's whole per-step cost) and nanoGPT (the peer's GPT and optimizer, never copied).
MFU is `GPT.flops_per_token` x tokens/s over the device's dense bf16 peak; compile s is the warm-up's time less
`--warmup` timed steps. A row that fails is recorded with its reason and the others go on."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import TensorDataset

from posgpt.benchmarks.common import SEED, Bench, cell, check_at_least, check_schemes, table_head, table_line
from posgpt.core.cli import Command
from posgpt.core.errors import ConfigError
from posgpt.data.dataset import SeededStream
from posgpt.data.tokenizer import CharTokenizer
from posgpt.model import GPT, POS_ENCODINGS, GPTConfig
from posgpt.model.attention import SoftmaxAttention
from posgpt.model.masks import AttentionMask
from posgpt.training.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from posgpt.training.hardware import check_fp8, convert_to_fp8, peak_flops
from posgpt.training.logs import metrics_file
from posgpt.training.module import adamw
from posgpt.training.run import TrainingData, train

SCHEMES: dict[str, dict[str, Any]] = {
    **{scheme: {"pos_encoding": scheme} for scheme in POS_ENCODINGS},
    "fire-per-layer": {"pos_encoding": "fire", "fire_per_layer": True},
    "window": {"pos_encoding": "rope"},  # + attn_window and attn_sinks from the options
    "bigbird": {"pos_encoding": "rope", "attn_random_blocks": 3, "attn_sparse_block": 64},  # + the window's
    "sigmoid": {"pos_encoding": "rope", "attention": "sigmoid"},
    "differential": {"pos_encoding": "rope", "attention": "differential"},
    "stick_breaking": {"pos_encoding": "none", "attention": "stick_breaking"},
    "forgetting": {"pos_encoding": "none", "attention": "forgetting"},
    "mqa": {"pos_encoding": "rope", "n_kv_head": 1},
    "qk_norm": {"pos_encoding": "rope", "qk_norm": "gemma3"},
    "gate": {"pos_encoding": "rope", "attn_gate": "elementwise"},
    "sink_logits": {"pos_encoding": "rope", "attn_sink_logits": True},
    "softcap": {"pos_encoding": "rope", "attn_softcap": 50.0},
    "gemma3": {"pos_encoding": "rope", "qk_norm": "gemma3", "layout": ("local",) * 5 + ("global",),
               "kinds": {"local": {"attn_window": "window", "rope_base": 1e4}, "global": {"rope_base": 1e6}}},
    "irope": {"pos_encoding": "rope", "qk_norm": "llama4", "layout": ("local",) * 3 + ("global",),
              "kinds": {"local": {"attn_chunk": "window"},
                        "global": {"pos_encoding": "none", "attn_temperature_floor": "window"}}},
    "hybrid": {"pos_encoding": "rope", "layout": ("local",) * 3 + ("global",),
               "kinds": {"local": {"attn_window": "window"}, "global": {"pos_encoding": "none"}}},
    "gpt-oss": {"pos_encoding": "rope", "attn_sink_logits": True, "layout": ("banded", "dense"),
                "kinds": {"banded": {"attn_window": "window"}, "dense": {}}},
    "qwen3-next": {"pos_encoding": "rope", "rope_fraction": 0.25, "rope_partial": "neox",  # configs/qwen3_next.yaml's
                   "n_kv_head": 2, "rope_base": 1e7,
                   "layout": ("deltanet",) * 3 + ("attention",), "kinds": {"deltanet": {"attention": "gated_deltanet"},
                   "attention": {"qk_norm": "gemma3", "attn_gate": "elementwise"}}},
}  # fmt: skip
"""Row labels and the model settings of each; in a layout's kinds, "window" is the options' window."""
WINDOWED = ("window", "bigbird")
MODELS: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257},  # GPT-2 124M
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256},  # the suite's CPU mode
}
GPU_SHAPES = ["16x1024", "32x1024", "4x4096", "1x16384", "1x32768"]
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclass
class GpuBenchConfig:
    """Training tokens/s, MFU, peak memory and compile time per scheme and shape; the Lightning
    trainer's overhead; nanoGPT's step beside ours."""

    schemes: list[str] = field(default_factory=lambda: list(SCHEMES))
    """Our rows: a pos_encoding, fire-per-layer, window, bigbird, sigmoid, differential, stick_breaking, forgetting;
    the layer options mqa, qk_norm, gate, sink_logits, softcap; the layouts gemma3, irope, hybrid, gpt-oss."""
    shapes: list[str] | None = None
    """Batch x context, e.g. 16x1024 (default: 16x1024 32x1024 4x4096 1x16384 1x32768 on a GPU, 4x64 on a CPU)."""
    model: Literal["auto", "gpt2", "tiny"] = "auto"
    """gpt2: GPT-2 124M (12 x 12 x 768, vocab 50257); tiny: 2 x 2 x 64, vocab 256; auto: gpt2 on a GPU."""
    steps: int | None = None
    """Timed steps per row (default: 20 on a GPU, 3 on a CPU)."""
    warmup: int = 3
    """Untimed steps first (compilation happens there)."""
    compile: bool = True
    """torch.compile the model, as --train.compile true does (and nanoGPT's default)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode."""
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA's backend for the rows that run on SDPA (ours and nanoGPT's): auto lets PyTorch pick."""
    window: int = 1024
    """The window row's attn_window."""
    sinks: int = 4
    """The window row's attn_sinks."""
    chunked_loss: bool = False
    """Ours with GPTConfig.chunked_loss (the (B, T, V) logits never formed whole)."""
    activation_checkpointing: bool = False
    """Ours with --train.activation_checkpointing (blocks recomputed in the backward pass)."""
    fp8: bool = False
    """Ours with --train.fp8 (torchao float8 linear layers; GPUs of compute capability 8.9+)."""
    trainer: list[str] = field(default_factory=lambda: ["rope"])
    """Schemes also timed through the Lightning trainer, at every shape (an empty list: none)."""
    strategy: str = "auto"
    """The trainer rows' --train.strategy (fsdp2: sharded, over the one device: what FSDP2 costs beside auto)."""
    peer: str | None = None
    """nanoGPT's directory (default: ../shared/peers/nanoGPT beside the repository); `none` skips its rows."""
    json: str | None = None
    """Append each row to this file as one JSON object per line, as it finishes."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""

    def __post_init__(self) -> None:
        check_schemes([*self.schemes, *self.trainer], list(SCHEMES))
        if not self.schemes:
            raise ConfigError("--schemes needs at least one value.")
        for shape in self.shapes or []:
            parse_shape(shape)
        check_at_least(1, steps=self.steps, warmup=self.warmup, window=self.window)
        check_at_least(0, sinks=self.sinks)


def parse_shape(text: str) -> tuple[int, int]:
    """'16x1024' -> (16, 1024)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"--shapes {text!r}: write each shape as BATCHxCONTEXT, e.g. 16x1024.")
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class Row:
    """One timed run: what the table shows and the JSON file keeps."""

    model: str
    scheme: str
    kernel: str
    batch: int
    context: int
    ms_per_step: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mib: float | None = None
    compile_s: float | None = None
    note: str = ""
    """Why a row has no figures (out of memory, an error)."""


class Setup(Bench):
    args: GpuBenchConfig

    def __init__(self, args: GpuBenchConfig) -> None:
        super().__init__(args)
        self.model = args.model if args.model != "auto" else ("gpt2" if self.cuda else "tiny")
        self.shapes = [parse_shape(s) for s in (args.shapes or (GPU_SHAPES if self.cuda else ["4x64"]))]
        self.steps = args.steps or (20 if self.cuda else 3)
        self.precision = "bf16-mixed" if self.cuda else "32-true"
        if args.fp8:
            check_fp8("gpu" if self.cuda else "cpu", "bf16-mixed", option="--fp8")
        torch.set_float32_matmul_precision("high")  # as train.py sets it: every row alike (the trainer's too)

    def sdpa(self) -> contextlib.AbstractContextManager:
        backend = self.args.sdpa_backend
        return contextlib.nullcontext() if backend == "auto" else sdpa_kernel(SDPA_BACKENDS[backend])

    def config(self, scheme: str, context: int) -> GPTConfig:
        extra = {"attn_window": self.args.window, "attn_sinks": self.args.sinks} if scheme in WINDOWED else {}
        settings = dict(SCHEMES[scheme])
        if "kinds" in settings:  # a layout's windows and chunks: the options' window
            settings["kinds"] = {name: {f: self.args.window if v == "window" else v for f, v in kind.items()}
                                 for name, kind in settings["kinds"].items()}  # fmt: skip
        return GPTConfig(**MODELS[self.model], block_size=context, bias=False, dropout=0.0,
                         chunked_loss=self.args.chunked_loss, **settings, **extra)  # fmt: skip


def random_tokens(vocab: int, context: int, batch_size: int) -> SeededStream:
    """Batches of random tokens, a function of (seed, index) alone, as the trainer's streams are."""

    def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([SEED, index])
        tokens = torch.from_numpy(rng.integers(0, vocab, (batch_size, context + 1), dtype=np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return SeededStream(batch)


def logged_tokens_per_s(run_dir: Path) -> list[float]:
    with open(metrics_file(run_dir), encoding="utf-8") as file:
        return [float(row["perf/tokens_per_s"]) for row in csv.DictReader(file) if row["perf/tokens_per_s"]]


def timed(setup: Setup, row: Row, model: nn.Module, optimizer: torch.optim.Optimizer, vocab: int, flops: int) -> Row:
    """`row` with the figures of train.py's step (the model compiled as --train.compile true does, a random batch
    copied to the device as a trainer's loader hands it over): --warmup steps, then --steps timed ones."""
    if setup.args.compile:
        torch._dynamo.reset()  # this row's compilation is its own
        model.compile(mode=setup.args.compile_mode)
    batches = iter(random_tokens(vocab, row.context, row.batch))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if setup.cuda else contextlib.nullcontext()

    def step() -> None:
        x, y = (t.pin_memory() if setup.cuda else t for t in next(batches))
        with setup.sdpa(), autocast:
            _, loss = model(x.to(setup.device, non_blocking=True), y.to(setup.device, non_blocking=True))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warmup = setup.time_tokens(step() for _ in range(setup.args.warmup))[1]
    setup.reset_peak()
    per_step = setup.time_tokens(step() for _ in range(setup.steps))[1] / setup.steps
    return figures(setup, row, per_step, flops, max(0.0, warmup - setup.args.warmup * per_step))


def figures(setup: Setup, row: Row, per_step: float, flops: int, compile_s: float | None) -> Row:
    tokens_per_s = row.batch * row.context / per_step
    peak = peak_flops(setup.device, setup.precision)
    mfu = tokens_per_s * flops / peak if peak else None
    return dataclasses.replace(row, ms_per_step=1000 * per_step, tokens_per_s=tokens_per_s, mfu=mfu,
                               peak_mib=setup.peak_mib(), compile_s=compile_s)  # fmt: skip


def run_step(setup: Setup, row: Row) -> Row:
    """Our GPT or nanoGPT's (learned positions, `peer_model`, with its optimizer groups) in train.py's step."""
    setup.free()
    if row.model == "nanoGPT":
        shape = MODELS[setup.model]
        model = setup.peer_model(shape, SEED, block_size=row.context)
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its optimizer groups
            optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), setup.device.type)
        n_params = model.get_num_params()  # without its position table, as our N; its layers: softmax attention's
        mixing = SoftmaxAttention.mixing_flops(GPTConfig(**shape, block_size=row.context), AttentionMask(), row.context)
        flops = 6 * n_params + shape["n_layer"] * mixing
        return timed(setup, row, model, optimizer, shape["vocab_size"], flops)
    config = setup.config(row.scheme, row.context)
    torch.manual_seed(SEED)
    with setup.device:
        model = GPT(config)
    model.activation_checkpointing = setup.args.activation_checkpointing
    if setup.args.fp8:
        convert_to_fp8(model)
    kernels = (k.attention.kernel_name(model.kernel(setup.device, False, True, kind=k)) for k in model.kinds)
    row = dataclasses.replace(row, kernel="/".join(dict.fromkeys(kernels)))  # a layout's kinds: different kernels
    optimizer = adamw(model, OptimConfig(lr=6e-4, beta2=0.95), setup.device)
    return timed(setup, row, model, optimizer, config.vocab_size, model.flops_per_token(row.context))


def run_lightning(setup: Setup, row: Row) -> Row:
    """The same model through the trainer: its last tokens/s reading over 1 + 2 x --steps steps (logged every
    --steps after the first, which compiles), on random training batches and one validation batch."""
    config, args, batch = setup.config(row.scheme, row.context), setup.args, row.batch
    stream = random_tokens(config.vocab_size, row.context, batch)
    validation = TensorDataset(*(t[None] for t in stream.batch(10**9)))  # one item: that batch
    data = TrainingData(
        L.LightningDataModule.from_datasets(stream, validation, batch_size=None),
        CharTokenizer(map(chr, range(config.vocab_size))),  # all the trainer reads of it: the vocabulary's size
        {"prepared": "random tokens", "fingerprint": f"random-{SEED}"},
        "random",
    )
    setup.free()
    setup.reset_peak()
    with tempfile.TemporaryDirectory() as tmp, setup.sdpa():
        train_config = TrainConfig(
            max_steps=1 + 2 * setup.steps, batch_size=batch, eval_interval=10**9, log_interval=setup.steps,
            ckpt_interval=10**9, out_dir=tmp, run_name="lightning", progress_bar=False, sample_tokens=0,
            precision=setup.precision, compile=args.compile, compile_mode=args.compile_mode,
            activation_checkpointing=args.activation_checkpointing, fp8=args.fp8, strategy=args.strategy,
            accelerator="gpu" if setup.cuda else "cpu", devices=f"{setup.device.index}," if setup.device.index else 1,
        )  # fmt: skip
        run = RunConfig(model=config, data=DataConfig(input=None, dir=tmp), optim=OptimConfig(), train=train_config)
        torch._dynamo.reset()
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # its model summary and notices
            warnings.simplefilter("ignore")
            tokens_per_s = logged_tokens_per_s(train(run, data).run_dir)[-1]
    with torch.device("meta"):  # counted on a model without storage
        flops = GPT(config).flops_per_token(row.context)
    return figures(setup, row, batch * row.context / tokens_per_s, flops, None)


def guarded(setup: Setup, label: Row) -> Row:
    """The row `label` names, measured, or `label` with the reason it could not be (out of memory, an error: its
    traceback on stderr), so that one failing row does not end a table being gathered."""
    try:
        return (run_lightning if label.model == "lightning" else run_step)(setup, label)
    except torch.OutOfMemoryError:
        note = "out of memory"
    except Exception as error:  # noqa: BLE001 - a benchmark table records the failure and goes on
        traceback.print_exc()
        note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    return dataclasses.replace(label, note=note)


HEAD = ["model", "scheme", "kernel", "B x T", "ms/step", "tokens/s", "MFU", "peak GiB", "compile s", "note"]


def row_line(row: Row) -> str:
    return table_line([row.model, row.scheme, row.kernel, f"{row.batch} x {row.context}", cell(row.ms_per_step, ".1f"),
                       cell(row.tokens_per_s, ",.0f"), cell(row.mfu, ".1f", 100), cell(row.peak_mib, ".2f", 1 / 1024),
                       cell(row.compile_s, ".1f"), row.note])  # fmt: skip


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


def bench_gpu(args: GpuBenchConfig) -> None:
    setup = Setup(args)
    print(f"{setup.name}, {setup.precision}, torch {torch.__version__}; model {setup.model} "
          f"{MODELS[setup.model]}, no biases; {args.warmup} warm-up + {setup.steps} timed steps; compile "
          f"{args.compile} ({args.compile_mode}), SDPA backend {args.sdpa_backend}, chunked loss {args.chunked_loss}, "
          f"activation checkpointing {args.activation_checkpointing}, fp8 {args.fp8}, trainer strategy "
          f"{args.strategy}; window row: RoPE, window "
          f"{args.window}, {args.sinks} sinks; peak memory: {setup.memory}")  # fmt: skip
    if args.peer != "none":
        setup.load_peer(args.peer)
    print("\n".join(table_head(HEAD)), flush=True)
    switches = ("chunked_loss", "activation_checkpointing", "fp8")  # what changes our rows' step, not nanoGPT's
    options = {name: getattr(args, name) for name in ("compile", "compile_mode", "sdpa_backend", "strategy", *switches)}
    for batch, context in setup.shapes:  # ours per scheme, the trainer's, nanoGPT's
        planned = [*(("posgpt", s) for s in args.schemes), *(("lightning", s) for s in args.trainer)]
        for model, scheme in [*planned, *([("nanoGPT", "learned")] if setup.peer else [])]:
            row = guarded(setup, Row(model, scheme, "sdpa" if model == "nanoGPT" else "", batch, context))
            setup.add(row, row_line(row), {"precision": setup.precision, "shape": setup.model, **MODELS[setup.model],
                      **dataclasses.asdict(row), **options, "steps": setup.steps, "warmup": args.warmup})  # fmt: skip
    print("\n" + "\n".join(ratios(setup.rows)))
    on = [name for name in switches if options[name]]
    if on and setup.peer is not None:
        print(f"note: our rows ran with {', '.join(on)}, nanoGPT's without: its ratios compare unlike steps")


COMMAND = Command("bench.py gpu", GpuBenchConfig, bench_gpu, GpuBenchConfig.__doc__, logs=False)
