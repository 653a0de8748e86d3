"""Decode speed per position scheme, eager and compiled, against nanoGPT (`python bench.py decode`).

Each row is one (scheme, mode, batch): seeded random weights, a random prompt, then `--tokens` new tokens
through `model.generation.stream` (sample.py's KV-cached path), compile and warm-up left out of the timed
run. nanoGPT's `generate` (no KV cache) runs on the same shape, its model.py imported from the peer directory.
`--json FILE` appends each row as it finishes, so a GPU table can be gathered over several commands.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import nn
from torch._dynamo.utils import counters

from benchmarks.common import PeakMemory, append_json, cell, device_name, load_peer, sync, table_head, table_line
from core.cli import Command
from core.device import pick_device_dtype
from core.errors import ConfigError, did_you_mean
from model import GPT, POS_ENCODINGS, GPTConfig
from model.generation import compile_for_decoding, stream

SHAPES: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50257},  # GPT-2 124M
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "vocab_size": 65},  # shakespeare_char
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 64},  # the test's
}
SEED = 1337
WARMUP_TOKENS = 4
"""Tokens decoded before each timed run: compilation and first-call costs (CUDA handles, oneDNN primitives)."""


@dataclass
class DecodeBenchConfig:
    """Decoding per scheme, eager and compiled, against nanoGPT's generate; CPU or GPU.

    Tokens/s, time to the first token, compile time and peak memory at each batch size."""

    schemes: list[str] = field(default_factory=lambda: ["learned", "rope", "alibi"])
    """Position schemes, each a key of model.POS_ENCODINGS."""
    batches: list[int] = field(default_factory=lambda: [1, 64])
    """Batch sizes (sequences decoded together)."""
    tokens: int | None = None
    """New tokens per run (default: 1000 on CUDA, 200 on a CPU)."""
    prompt_tokens: int = 1
    """Prompt length (random token ids)."""
    shape: Literal["auto", "gpt2", "small", "tiny"] = "auto"
    """Model shape: gpt2 (GPT-2 124M, block 1024, vocab 50257), small (6 x 6 x 384, block 256, vocab 65),
    tiny (2 x 2 x 32, block 32, vocab 64); auto is gpt2 on CUDA, small on a CPU."""
    modes: list[Literal["eager", "compiled"]] = field(default_factory=lambda: ["eager", "compiled"])
    """eager, and compiled (model.generation.compile_for_decoding)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations: auto is bfloat16 on a GPU that has it, else float32."""
    json: str | None = None
    """Append each row to this file as one JSON object per line, as it finishes."""
    peer: str | None = None
    """nanoGPT's directory (default: ../shared/peers/nanoGPT beside the repository); where it has no
    model.py its rows are skipped with a note (--peer none)."""
    top_k: int = 200
    """Sample among the k most likely tokens (0: all)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (nanoGPT's generate then samples with top_k 1, the same choice)."""

    def __post_init__(self) -> None:
        for scheme in self.schemes:
            if scheme not in POS_ENCODINGS:
                hint = did_you_mean(scheme, POS_ENCODINGS, "")
                raise ConfigError(f"--schemes: no scheme {scheme!r}; choose among {', '.join(POS_ENCODINGS)}{hint}")
        for name, values in (("schemes", self.schemes), ("batches", self.batches), ("modes", self.modes)):
            if not values:
                raise ConfigError(f"--{name} needs at least one value.")
        counts = {"batches": min(self.batches), "tokens": 1 if self.tokens is None else self.tokens,
                  "prompt_tokens": self.prompt_tokens}  # fmt: skip
        for name, value in counts.items():
            if value < 1:
                raise ConfigError(f"--{name} must be at least 1, got {value}.")
        if self.top_k < 0:
            raise ConfigError(f"--top_k must be at least 0 (0: all tokens), got {self.top_k}.")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        pick_device_dtype(self.device, self.dtype)  # a device this machine has


@dataclass(frozen=True)
class Row:
    """One timed decode: what the table shows and the JSON file keeps."""

    model: str
    scheme: str
    mode: str
    batch: int
    tokens_per_s: float
    first_token_ms: float
    compile_s: float | None
    """The warm-up's wall time, compiled rows only."""
    peak_mib: float | None
    graphs: int | None = None
    """Graphs Dynamo compiled for a compiled row: a prefill and a decode step (a third with a learned window)."""


@dataclass(frozen=True)
class Setup:
    """The resolved run: what every row shares."""

    args: DecodeBenchConfig
    device: torch.device
    dtype: torch.dtype
    shape: str
    tokens: int
    memory: PeakMemory

    def prompt(self, batch: int) -> torch.Tensor:
        """Seeded random prompt ids (batch, prompt_tokens)."""
        generator = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, SHAPES[self.shape]["vocab_size"], (batch, self.args.prompt_tokens), generator=generator)
        return ids.to(self.device)


def resolve(args: DecodeBenchConfig) -> Setup:
    device, dtype = pick_device_dtype(args.device, args.dtype)
    cuda = device.type == "cuda"
    shape = args.shape if args.shape != "auto" else ("gpt2" if cuda else "small")
    tokens = args.tokens if args.tokens is not None else (1000 if cuda else 200)
    return Setup(args, device, dtype, shape, tokens, PeakMemory(device))


def time_tokens(setup: Setup, tokens: Iterator[torch.Tensor]) -> tuple[float, float]:
    """(seconds to the first token, seconds to the last) of a token iterator, timed from before its
    first step (a generator does nothing until asked)."""
    sync(setup.device)
    start = time.perf_counter()
    first = None
    for _ in tokens:
        if first is None:
            sync(setup.device)
            first = time.perf_counter() - start
    sync(setup.device)
    return first or 0.0, time.perf_counter() - start


def run_ours(setup: Setup, scheme: str, mode: str, batch: int) -> Row:
    args = setup.args
    setup.memory.start()
    torch.manual_seed(SEED)
    config = GPTConfig(**SHAPES[setup.shape], pos_encoding=scheme, bias=False, dropout=0.0)
    with setup.device:  # built there: GPT-2's 124M would take seconds to init on a CPU
        model = GPT(config).to(dtype=setup.dtype).eval()
    if mode == "compiled":
        torch._dynamo.reset()  # this row's compile is its own, and no earlier model counts towards recompile limits
        compile_for_decoding(model)
    idx = setup.prompt(batch)
    graphs_before = counters["stats"]["unique_graphs"]

    def decode(n: int) -> Iterator[torch.Tensor]:
        generator = torch.Generator(device=setup.device).manual_seed(SEED)
        return stream(model, idx, n, args.temperature, args.top_k or None, generator=generator)

    warmup = time_tokens(setup, itertools.islice(decode(setup.tokens), WARMUP_TOKENS))[1]  # the run's cache size
    setup.memory.reset()
    first, total = time_tokens(setup, decode(setup.tokens))
    compiled = mode == "compiled"
    graphs = counters["stats"]["unique_graphs"] - graphs_before if compiled else None
    return Row("posgpt", scheme, mode, batch, batch * setup.tokens / total, 1000 * first,
               warmup if compiled else None, setup.memory.peak_mib(), graphs)  # fmt: skip


def run_nanogpt(setup: Setup, peer: Callable[..., nn.Module], batch: int) -> Row:
    """nanoGPT's GPT with learned positions (`peer_model`), timed through its `generate`."""
    args = setup.args
    setup.memory.start()
    model = peer(SHAPES[setup.shape], setup.device, SEED).to(dtype=setup.dtype).eval()
    idx = setup.prompt(batch)
    greedy = args.temperature == 0  # its generate divides by the temperature: top_k 1 is its greedy
    temperature, top_k = (1.0, 1) if greedy else (args.temperature, args.top_k or None)

    @torch.no_grad()
    def generate(n: int) -> Iterator[torch.Tensor]:  # its generate yields nothing before the end
        yield model.generate(idx, n, temperature=temperature, top_k=top_k)

    time_tokens(setup, generate(WARMUP_TOKENS))
    setup.memory.reset()
    first = time_tokens(setup, generate(1))[1]
    total = time_tokens(setup, generate(setup.tokens))[1]
    return Row("nanoGPT", "learned", "eager", batch, batch * setup.tokens / total, 1000 * first, None,
               setup.memory.peak_mib())  # fmt: skip


def row_line(row: Row) -> str:
    cells = [row.model, row.scheme, row.mode, str(row.batch), cell(row.tokens_per_s, ",.1f"),
             cell(row.first_token_ms, ",.1f"), cell(row.compile_s, ",.1f"), cell(row.peak_mib, ",.0f"),
             cell(row.graphs, "d")]  # fmt: skip
    return table_line(cells)


def summary(rows: list[Row], batches: list[int]) -> list[str]:
    """The table for BENCHMARKS.md: one line per model, scheme and mode, tokens/s per batch in its
    own column, the other figures per batch as `a / b`."""
    per = " / ".join(map(str, batches))
    head = ["model", "scheme", "mode", *(f"tokens/s b={b}" for b in batches), f"first token ms (b={per})",
            f"compile s (b={per})", f"peak MiB (b={per})", f"graphs (b={per})"]  # fmt: skip
    lines = table_head(head)
    groups: dict[tuple[str, str, str], dict[int, Row]] = {}
    for row in rows:
        groups.setdefault((row.model, row.scheme, row.mode), {})[row.batch] = row
    for key, by_batch in groups.items():
        got = [by_batch.get(b) for b in batches]
        speeds = [cell(r.tokens_per_s if r else None, ",.1f") for r in got]
        joined = [
            " / ".join(cell(getattr(r, name) if r else None, f",.{digits}f") for r in got)
            for name, digits in (("first_token_ms", 1), ("compile_s", 1), ("peak_mib", 0), ("graphs", 0))
        ]
        lines.append(table_line([*key, *speeds, *joined]))
    return lines


def record(setup: Setup, row: Row) -> None:
    """Print the row and append it to --json (with what a reader needs to reproduce it)."""
    print(row_line(row), flush=True)
    append_json(setup.args.json, {"device": device_name(setup.device), "dtype": str(setup.dtype).removeprefix("torch."),
                "shape": setup.shape, **SHAPES[setup.shape], "prompt_tokens": setup.args.prompt_tokens,
                "new_tokens": setup.tokens, "temperature": setup.args.temperature, "top_k": setup.args.top_k,
                **asdict(row), "memory": setup.memory.label})  # fmt: skip


def bench_decode(args: DecodeBenchConfig) -> None:
    setup = resolve(args)
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top_k {args.top_k or 'all'}"
    print(f"{device_name(setup.device)}, {str(setup.dtype).removeprefix('torch.')}, torch {torch.__version__}; "
          f"shape {setup.shape} {SHAPES[setup.shape]}, no biases; prompt {args.prompt_tokens} tokens, "
          f"{setup.tokens} new tokens, {sampling}")  # fmt: skip
    peer = load_peer(args.peer)
    head = ["model", "scheme", "mode", "batch", "tokens/s", "first token ms", "compile s", setup.memory.label, "graphs"]
    print("\n".join(table_head(head)), flush=True)
    rows = []
    for scheme in args.schemes:
        for mode in args.modes:
            for batch in args.batches:
                rows.append(run_ours(setup, scheme, mode, batch))
                record(setup, rows[-1])
    for batch in args.batches if peer is not None else []:
        rows.append(run_nanogpt(setup, peer, batch))
        record(setup, rows[-1])
    print(f"\nSummary (peak MiB: {setup.memory.how}; nanoGPT: its generate, no KV cache):")
    print("\n".join(summary(rows, args.batches)))


DECODE = Command("bench.py decode", DecodeBenchConfig, bench_decode, DecodeBenchConfig.__doc__, logs=False)
