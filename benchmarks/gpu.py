"""Training speed per position scheme and shape, against nanoGPT's step and through the Lightning
trainer (`python bench.py gpu`).

Each row trains a freshly built model on random tokens for `--warmup` steps, then times `--steps` more of
train.py's step (autocast forward, backward, clipping, fused AdamW). Rows: posgpt (our GPT on the kernel
`auto` picks, compiled as `--train.compile true` does), lightning (the same through `training.run.train`,
its own tokens/s: the trainer's whole per-step cost) and nanoGPT (the peer's GPT and optimizer, never
copied). MFU is `GPT.flops_per_token` x tokens/s over the device's dense bf16 peak; compile s is the
warm-up's time less `--warmup` timed steps. A row that fails is recorded with its reason and the others go
on; each is appended to `--json` as it finishes. On a CPU a tiny model runs at a small shape (the tests').
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import io
import itertools
import logging
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import TensorDataset

from benchmarks.common import PeakMemory, append_json, cell, device_name, load_peer, sync, table_head, table_line
from core.cli import Command
from core.device import pick_device_dtype
from core.errors import ConfigError, did_you_mean
from data.dataset import SeededStream
from model import GPT, POS_ENCODINGS, GPTConfig
from model.gpt import training_flops_per_token
from training.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from training.hardware import check_fp8, convert_to_fp8, peak_flops
from training.logs import metrics_file
from training.module import adamw
from training.run import TrainingData, train

SCHEMES: dict[str, dict[str, Any]] = {
    **{scheme: {"pos_encoding": scheme} for scheme in POS_ENCODINGS},
    "fire-per-layer": {"pos_encoding": "fire", "fire_per_layer": True},
    "window": {"pos_encoding": "rope"},  # + attn_window and attn_sinks from the options
    "bigbird": {"pos_encoding": "rope", "attn_random_blocks": 3, "attn_sparse_block": 64},  # + the window's
    "sigmoid": {"pos_encoding": "rope", "attention": "sigmoid"},
    "differential": {"pos_encoding": "rope", "attention": "differential"},
    "stick_breaking": {"pos_encoding": "none", "attention": "stick_breaking"},
    "forgetting": {"pos_encoding": "none", "attention": "forgetting"},
}
"""Row labels and the model settings of each."""
WINDOWED = ("window", "bigbird")
MODELS: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257},  # GPT-2 124M
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256},  # the suite's CPU mode
}
GPU_SHAPES = ["16x1024", "32x1024", "4x4096", "1x16384", "1x32768"]
CPU_SHAPES = ["4x64"]
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SEED = 1337


@dataclass
class GpuBenchConfig:
    """Training tokens/s, MFU, peak memory and compile time per scheme and shape; the Lightning
    trainer's overhead; nanoGPT's step beside ours."""

    schemes: list[str] = field(default_factory=lambda: list(SCHEMES))
    """Rows of ours: every position scheme by name, fire-per-layer, window (RoPE + --window and --sinks), bigbird
    (that + random blocks), sigmoid, differential, stick_breaking and forgetting (the last two without positions)."""
    shapes: list[str] | None = None
    """Batch x context, e.g. 16x1024 (default: 16x1024 32x1024 4x4096 1x16384 1x32768 on a GPU, 4x64 on a CPU)."""
    model: Literal["auto", "gpt2", "tiny"] = "auto"
    """gpt2: GPT-2 124M (12 x 12 x 768, vocab 50257); tiny: 2 x 2 x 64, vocab 256; auto: gpt2 on a GPU, tiny on
    a CPU."""
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
    peer: str | None = None
    """nanoGPT's directory (default: ../shared/peers/nanoGPT beside the repository); `none` skips its rows."""
    json: str | None = None
    """Append each row to this file as one JSON object per line, as it finishes."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""

    def __post_init__(self) -> None:
        for scheme in [*self.schemes, *self.trainer]:
            if scheme not in SCHEMES:
                raise ConfigError(
                    f"no scheme {scheme!r}; choose among {', '.join(SCHEMES)}{did_you_mean(scheme, SCHEMES, '')}"
                )
        if not self.schemes:
            raise ConfigError("--schemes needs at least one value.")
        for shape in self.shapes or []:
            parse_shape(shape)
        for name in ("steps", "warmup", "window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be at least 1, got {value}.")
        if self.sinks < 0:
            raise ConfigError(f"--sinks must be at least 0, got {self.sinks}.")
        pick_device_dtype(self.device, "auto")  # a device this machine has


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


@dataclass
class Setup:
    """The resolved run: what every row shares."""

    args: GpuBenchConfig
    device: torch.device
    model: str
    shapes: list[tuple[int, int]]
    steps: int
    memory: PeakMemory

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        return "bf16-mixed" if self.cuda else "32-true"

    def sdpa(self) -> contextlib.AbstractContextManager:
        backend = self.args.sdpa_backend
        return contextlib.nullcontext() if backend == "auto" else sdpa_kernel(SDPA_BACKENDS[backend])

    def config(self, scheme: str, context: int) -> GPTConfig:
        extra = {"attn_window": self.args.window, "attn_sinks": self.args.sinks} if scheme in WINDOWED else {}
        return GPTConfig(**MODELS[self.model], block_size=context, bias=False, dropout=0.0,
                         chunked_loss=self.args.chunked_loss, **SCHEMES[scheme], **extra)  # fmt: skip


def resolve(args: GpuBenchConfig) -> Setup:
    device, _ = pick_device_dtype(args.device, "auto")
    cuda = device.type == "cuda"
    model = args.model if args.model != "auto" else ("gpt2" if cuda else "tiny")
    shapes = [parse_shape(s) for s in (args.shapes or (GPU_SHAPES if cuda else CPU_SHAPES))]
    steps = args.steps or (20 if cuda else 3)
    if args.fp8:
        check_fp8("gpu" if cuda else "cpu", "bf16-mixed", option="--fp8")
    torch.set_float32_matmul_precision("high")  # as train.py sets it: every row alike (the trainer's too)
    return Setup(args, device, model, shapes, steps, PeakMemory(device))


class RandomTokens(SeededStream):
    """Batches of random tokens, a function of (seed, index) alone, as the trainer's streams are."""

    def __init__(self, vocab: int, context: int, batch_size: int) -> None:
        super().__init__(batch_size, SEED, 0, lambda: 0)
        self.vocab, self.context = vocab, context

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([SEED, index])
        tokens = torch.from_numpy(rng.integers(0, self.vocab, (self.batch_size, self.context + 1), dtype=np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclass(frozen=True)
class RandomVocabulary:
    """What the trainer reads of a tokenizer when it samples nothing: the vocabulary's size and a
    description for the checkpoint."""

    vocab_size: int
    end_id: int | None = None

    def meta(self) -> dict[str, Any]:
        return {"kind": "random", "vocab_size": self.vocab_size}


def logged_tokens_per_s(run_dir: Path) -> list[float]:
    """The tokens/s readings a run logged in its metrics file."""
    with open(metrics_file(run_dir), encoding="utf-8") as file:
        return [float(row["perf/tokens_per_s"]) for row in csv.DictReader(file) if row["perf/tokens_per_s"]]


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Keep the trainer's model summary, notices and warnings out of the table."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def timed(setup: Setup, row: Row, model: nn.Module, optimizer: torch.optim.Optimizer, vocab: int, flops: int) -> Row:
    """`row` with the figures of train.py's step: a random batch copied to the device as a trainer's loader hands
    it over (pinned on a GPU), forward (bf16 autocast on a GPU), backward, clipping of the global gradient norm,
    the optimizer step; --warmup steps, then --steps timed ones, the peak-memory mark reset between them."""
    stream, index = RandomTokens(vocab, row.context, row.batch), itertools.count()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if setup.cuda else contextlib.nullcontext()

    def step() -> None:
        x, y = (t.pin_memory() if setup.cuda else t for t in stream.batch(next(index)))
        with setup.sdpa(), autocast:
            _, loss = model(x.to(setup.device, non_blocking=True), y.to(setup.device, non_blocking=True))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync(setup.device)
    start = time.perf_counter()
    for _ in range(setup.args.warmup):
        step()
    sync(setup.device)
    warmup = time.perf_counter() - start
    setup.memory.reset()
    start = time.perf_counter()
    for _ in range(setup.steps):
        step()
    sync(setup.device)
    per_step = (time.perf_counter() - start) / setup.steps
    return figures(setup, row, per_step, flops, max(0.0, warmup - setup.args.warmup * per_step))


def run_ours(setup: Setup, scheme: str, batch: int, context: int) -> Row:
    config = setup.config(scheme, context)
    setup.memory.start()
    torch.manual_seed(SEED)
    with setup.device:
        model = GPT(config)
    model.activation_checkpointing = setup.args.activation_checkpointing
    if setup.args.fp8:
        convert_to_fp8(model)
    kernel = model.attention.kernel_name(model.kernel(setup.device, dropout=False, needs_grad=True))
    if setup.args.compile:
        torch._dynamo.reset()  # this row's compilation is its own
        model.compile(mode=setup.args.compile_mode)
    optimizer = adamw(model, OptimConfig(lr=6e-4, beta2=0.95), setup.device)
    row = Row("posgpt", scheme, kernel, batch, context)
    return timed(setup, row, model, optimizer, config.vocab_size, model.flops_per_token(context))


def figures(setup: Setup, row: Row, per_step: float, flops: int, compile_s: float | None) -> Row:
    tokens_per_s = row.batch * row.context / per_step
    peak = peak_flops(setup.device, setup.precision)
    mfu = tokens_per_s * flops / peak if peak else None
    return dataclasses.replace(row, ms_per_step=1000 * per_step, tokens_per_s=tokens_per_s, mfu=mfu,
                               peak_mib=setup.memory.peak_mib(), compile_s=compile_s)  # fmt: skip


def run_nanogpt(setup: Setup, peer: Callable[..., Any], batch: int, context: int) -> Row:
    """nanoGPT's GPT (learned positions, `peer_model`), its optimizer groups and torch.compile, in the same
    step as ours."""
    shape = MODELS[setup.model]
    setup.memory.start()
    model = peer(shape, setup.device, SEED, block_size=context)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its optimizer groups
        optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), setup.device.type)
    n_params = model.get_num_params()  # without its position table, as our N
    if setup.args.compile:
        torch._dynamo.reset()
        model = torch.compile(model, mode=setup.args.compile_mode)
    flops = training_flops_per_token(n_params, shape["n_layer"], shape["n_embd"], context)
    return timed(setup, Row("nanoGPT", "learned", "sdpa", batch, context), model, optimizer, shape["vocab_size"], flops)


def run_lightning(setup: Setup, scheme: str, batch: int, context: int) -> Row:
    """The same model through the trainer: its last tokens/s reading over 1 + 2 x --steps steps (logged every
    --steps after the first, which compiles), on random training batches and one validation batch."""
    config, args = setup.config(scheme, context), setup.args
    stream = RandomTokens(config.vocab_size, context, batch)
    validation = TensorDataset(*(t[None] for t in stream.batch(10**9)))  # one item: that batch
    data = TrainingData(
        L.LightningDataModule.from_datasets(stream, validation, batch_size=None),
        RandomVocabulary(config.vocab_size),  # type: ignore[arg-type]  # all the trainer reads of a tokenizer
        {"prepared": "random tokens", "fingerprint": f"random-{SEED}"},
        "random",
    )
    setup.memory.start()
    setup.memory.reset()
    with tempfile.TemporaryDirectory() as tmp, setup.sdpa():
        train_config = TrainConfig(
            max_steps=1 + 2 * setup.steps, batch_size=batch, eval_interval=10**9, log_interval=setup.steps,
            ckpt_interval=10**9, out_dir=tmp, run_name="lightning", progress_bar=False, sample_tokens=0,
            precision=setup.precision, compile=args.compile, compile_mode=args.compile_mode,
            activation_checkpointing=args.activation_checkpointing, fp8=args.fp8,
            accelerator="gpu" if setup.cuda else "cpu", devices=f"{setup.device.index}," if setup.device.index else 1,
        )  # fmt: skip
        run = RunConfig(model=config, data=DataConfig(input=None, dir=tmp), optim=OptimConfig(), train=train_config)
        torch._dynamo.reset()
        with quiet_lightning():
            result = train(run, data)
        tokens_per_s = logged_tokens_per_s(result.run_dir)[-1]
    with torch.device("meta"):  # counted on a model without storage
        flops = GPT(config).flops_per_token(context)
    return figures(setup, Row("lightning", scheme, "", batch, context), batch * context / tokens_per_s, flops, None)


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


HEAD = ["model", "scheme", "kernel", "B x T", "ms/step", "tokens/s", "MFU", "peak GiB", "compile s", "note"]


def row_line(row: Row) -> str:
    cells = [row.model, row.scheme, row.kernel, f"{row.batch} x {row.context}", cell(row.ms_per_step, ".1f"),
             cell(row.tokens_per_s, ",.0f"), cell(None if row.mfu is None else 100 * row.mfu, ".1f"),
             cell(None if row.peak_mib is None else row.peak_mib / 1024, ".2f"), cell(row.compile_s, ".1f"),
             row.note]  # fmt: skip
    return table_line(cells)


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


def planned_rows(setup: Setup, peer: Callable[..., Any] | None) -> list[tuple[Row, Callable[[], Row]]]:
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
    print(f"{device_name(setup.device)}, {setup.precision}, torch {torch.__version__}; model {setup.model} "
          f"{MODELS[setup.model]}, no biases; {args.warmup} warm-up + {setup.steps} timed steps; compile "
          f"{args.compile} ({args.compile_mode}), SDPA backend {args.sdpa_backend}, chunked loss {args.chunked_loss}, "
          f"activation checkpointing {args.activation_checkpointing}, fp8 {args.fp8}; window row: RoPE, window "
          f"{args.window}, {args.sinks} sinks; peak memory: {setup.memory.how}")  # fmt: skip
    peer = None if args.peer == "none" else load_peer(args.peer)
    print("\n".join(table_head(HEAD)), flush=True)
    rows: list[Row] = []
    for label, run in planned_rows(setup, peer):
        rows.append(guarded(setup, label, run))
        record(setup, rows[-1])
    print("\n" + "\n".join(ratios(rows)))
    switches = [name for name in ("chunked_loss", "activation_checkpointing", "fp8") if getattr(args, name)]
    if switches and peer is not None:
        print(f"note: our rows ran with {', '.join(switches)}, nanoGPT's without: its ratios compare unlike steps")


GPU = Command("bench.py gpu", GpuBenchConfig, bench_gpu, GpuBenchConfig.__doc__, logs=False)
