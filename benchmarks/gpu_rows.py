"""The rows of `python bench.py gpu` (module docstring of benchmarks.gpu): its options, one timed
training step of ours, of nanoGPT's model and of the trainer, and the figures of each."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import PeakMemory
from benchmarks.trainer_row import RandomTokens, trainer_tokens_per_s
from core.device import pick_device_dtype
from core.errors import ConfigError, did_you_mean
from model import GPT, POS_ENCODINGS, GPTConfig
from model.gpt import training_flops_per_token
from training.config import OptimConfig
from training.fp8 import check_fp8, convert_to_fp8
from training.hardware import peak_flops
from training.module import adamw

SCHEMES: dict[str, dict[str, Any]] = {
    **{scheme: {"pos_encoding": scheme} for scheme in POS_ENCODINGS},
    "fire-per-layer": {"pos_encoding": "fire", "fire_per_layer": True},
    "window": {"pos_encoding": "rope"},  # + attn_window and attn_sinks from the options
    "bigbird": {"pos_encoding": "rope", "attn_random_blocks": 3, "attn_sparse_block": 64},  # + the window's
    "sigmoid": {"pos_encoding": "rope", "attention": "sigmoid"},
    "differential": {"pos_encoding": "rope", "attention": "differential"},
}
"""Row labels and the model settings of each: every position scheme; `window` RoPE with a sliding
window and sinks, `bigbird` that and 3 random blocks of 64 keys; sigmoid and differential attention
with RoPE."""
WINDOWED = ("window", "bigbird")
"""The rows that take --window and --sinks."""
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
    (that + random blocks), sigmoid, differential."""
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
    """posgpt, lightning or nanoGPT."""
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
    """Why a row has no figures (out of memory, an error), or what to know about it."""


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

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else contextlib.nullcontext()

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


def batches(setup: Setup, batch: int, context: int, vocab: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The trainer row's random batches (`RandomTokens`), copied to the device as a trainer's loader
    hands them over (pinned memory on a GPU)."""
    stream = RandomTokens(vocab, context, batch)
    for index in itertools.count():
        pair = stream.batch(index)
        if setup.cuda:
            pair = tuple(t.pin_memory() for t in pair)
        yield tuple(t.to(setup.device, non_blocking=True) for t in pair)


def training_step(
    setup: Setup, model: nn.Module, optimizer: torch.optim.Optimizer, data: Iterator
) -> Callable[[], None]:
    """One step as train.py takes it: forward (bf16 autocast on a GPU), backward, clipping of the
    global gradient norm, the optimizer step."""

    def step() -> None:
        x, y = next(data)
        with setup.sdpa(), setup.autocast():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_steps(setup: Setup, step: Callable[[], None]) -> tuple[float, float]:
    """(compile seconds, seconds per step): --warmup steps, then --steps timed ones, the peak-memory
    mark reset between them."""
    setup.sync()
    start = time.perf_counter()
    for _ in range(setup.args.warmup):
        step()
    setup.sync()
    warmup = time.perf_counter() - start
    setup.memory.reset()
    start = time.perf_counter()
    for _ in range(setup.steps):
        step()
    setup.sync()
    per_step = (time.perf_counter() - start) / setup.steps
    return max(0.0, warmup - setup.args.warmup * per_step), per_step


def kernel_name(model: GPT, device: torch.device) -> str:
    """The registry name of the attention kernel a training step of `model` runs on `device`."""
    return model.attention.kernel_name(model.kernel(device, dropout=False, needs_grad=True))


def run_ours(setup: Setup, scheme: str, batch: int, context: int) -> Row:
    config = setup.config(scheme, context)
    setup.memory.start()
    torch.manual_seed(SEED)
    with setup.device:
        model = GPT(config)
    model.activation_checkpointing = setup.args.activation_checkpointing
    if setup.args.fp8:
        convert_to_fp8(model)
    kernel = kernel_name(model, setup.device)
    if setup.args.compile:
        torch._dynamo.reset()  # this row's compilation is its own
        model.compile(mode=setup.args.compile_mode)
    optimizer = adamw(model, OptimConfig(lr=6e-4, beta2=0.95), setup.device)
    step = training_step(setup, model, optimizer, batches(setup, batch, context, config.vocab_size))
    compile_s, per_step = time_steps(setup, step)
    flops = model.flops_per_token(context)
    return figures(setup, Row("posgpt", scheme, kernel, batch, context), per_step, flops, compile_s)


def figures(setup: Setup, row: Row, per_step: float, flops: int, compile_s: float | None) -> Row:
    tokens_per_s = row.batch * row.context / per_step
    peak = peak_flops(setup.device, setup.precision)
    mfu = tokens_per_s * flops / peak if peak else None
    return dataclasses.replace(row, ms_per_step=1000 * per_step, tokens_per_s=tokens_per_s, mfu=mfu,
                               peak_mib=setup.memory.peak_mib(), compile_s=compile_s)  # fmt: skip


def run_nanogpt(setup: Setup, peer: Any, batch: int, context: int) -> Row:
    """nanoGPT's GPT (learned positions, no biases as ours, our padded vocabulary: 50304 for GPT-2,
    as its own GPT-2 runs), its optimizer groups and torch.compile, in the same step as ours."""
    shape = MODELS[setup.model]
    vocab = GPTConfig(vocab_size=shape["vocab_size"]).padded_vocab_size
    config = peer.GPTConfig(**{**shape, "vocab_size": vocab}, block_size=context, dropout=0.0, bias=False)
    setup.memory.start()
    torch.manual_seed(SEED)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count and optimizer groups
        with setup.device:
            model = peer.GPT(config)
        optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), setup.device.type)
    n_params = model.get_num_params()  # without its position table, as our N
    if setup.args.compile:
        torch._dynamo.reset()
        model = torch.compile(model, mode=setup.args.compile_mode)
    step = training_step(setup, model, optimizer, batches(setup, batch, context, shape["vocab_size"]))
    compile_s, per_step = time_steps(setup, step)
    flops = training_flops_per_token(n_params, shape["n_layer"], shape["n_embd"], context)
    return figures(setup, Row("nanoGPT", "learned", "sdpa", batch, context), per_step, flops, compile_s)


def run_lightning(setup: Setup, scheme: str, batch: int, context: int) -> Row:
    """The same model through the trainer (`benchmarks.trainer_row`)."""
    config, args = setup.config(scheme, context), setup.args
    options = {"precision": setup.precision, "compile": args.compile, "compile_mode": args.compile_mode,
               "activation_checkpointing": args.activation_checkpointing, "fp8": args.fp8,
               "accelerator": "gpu" if setup.cuda else "cpu",
               "devices": f"{setup.device.index}," if setup.device.index else 1}  # fmt: skip
    setup.memory.start()
    setup.memory.reset()
    with setup.sdpa():
        tokens_per_s = trainer_tokens_per_s(config, batch, setup.steps, options)
    row = Row("lightning", scheme, "", batch, context)
    return figures(setup, row, batch * context / tokens_per_s, _flops(config, context), None)


def _flops(config: GPTConfig, context: int) -> int:
    """`GPT.flops_per_token` of `config`, counted on a model without storage."""
    with torch.device("meta"):
        return GPT(config).flops_per_token(context)
