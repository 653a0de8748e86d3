"""Decode speed per position scheme, eager and compiled, against nanoGPT (`python bench.py decode`). Each row is
one (scheme, mode, batch): seeded random weights, a random prompt, then `--tokens` new tokens through sample.py's
KV-cached path, compile and warm-up left out of the timed run; nanoGPT's `generate` (no KV cache) on the same shape."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from typing import Literal

import torch
from torch._dynamo.utils import counters

from posgpt.benchmarks.common import SEED, Bench, cell, check_at_least, check_schemes, table_head, table_line
from posgpt.core.cli import Command
from posgpt.core.errors import ConfigError
from posgpt.model import GPT, POS_ENCODINGS, GPTConfig
from posgpt.model.generation import compile_for_decoding, stream
from posgpt.model.linear import onednn_linears
from posgpt.model.pretrained import NAMES, TRANSPOSED

SHAPES: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50257},  # GPT-2 124M
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "vocab_size": 65},  # shakespeare_char
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 64},  # the test's
}
WARMUP_TOKENS = 4
"""Tokens decoded before each timed run: compilation and first-call costs (CUDA handles, oneDNN primitives)."""
FIGURES = {"tokens_per_s": ",.1f", "first_token_ms": ",.1f", "compile_s": ",.1f", "peak_mib": ",.0f", "graphs": "d"}
"""A row's figures and their formats, in the columns' order of the live table and the summary."""


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
    """gpt2 (GPT-2 124M), small (6 x 6 x 384, block 256, vocab 65), tiny (2 x 2 x 32); auto: gpt2 on CUDA."""
    modes: list[Literal["eager", "compiled"]] = field(default_factory=lambda: ["eager", "compiled"])
    """eager, and compiled (model.generation.compile_for_decoding)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations: auto is bfloat16 on a GPU that has it, else float32."""
    json: str | None = None
    """Append each row to this file as one JSON object per line, as it finishes."""
    peer: str | None = None
    """nanoGPT's directory (default: ../shared/peers/nanoGPT beside the repository); without model.py: no rows."""
    top_k: int = 200
    """Sample among the k most likely tokens (0: all)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (nanoGPT's generate then samples with top_k 1, the same choice)."""
    hf: bool = True
    """Hugging Face's GPT-2 `generate` on the weights of the learned row (where transformers is installed)."""

    def __post_init__(self) -> None:
        check_schemes(self.schemes, POS_ENCODINGS, "--schemes: ")
        for name, values in (("schemes", self.schemes), ("batches", self.batches), ("modes", self.modes)):
            if not values:
                raise ConfigError(f"--{name} needs at least one value.")
        check_at_least(1, batches=min(self.batches), tokens=self.tokens, prompt_tokens=self.prompt_tokens)
        if self.top_k < 0:
            raise ConfigError(f"--top_k must be at least 0 (0: all tokens), got {self.top_k}.")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}.")


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


class Setup(Bench):
    args: DecodeBenchConfig

    def __init__(self, args: DecodeBenchConfig) -> None:
        super().__init__(args, args.dtype)
        self.shape = args.shape if args.shape != "auto" else ("gpt2" if self.cuda else "small")
        self.tokens = args.tokens if args.tokens is not None else (1000 if self.cuda else 200)
        self.dtype_name = str(self.dtype).removeprefix("torch.")

    def prompt(self, batch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, SHAPES[self.shape]["vocab_size"], (batch, self.args.prompt_tokens), generator=generator)
        return ids.to(self.device)


def our_model(setup: Setup, scheme: str) -> GPT:
    """A row's model: seeded, no biases, built on the device (GPT-2's 124M would take seconds to init on a CPU)."""
    torch.manual_seed(SEED)
    config = GPTConfig(**SHAPES[setup.shape], pos_encoding=scheme, bias=False, dropout=0.0)
    with setup.device:
        return GPT(config).to(dtype=setup.dtype).eval()


def run_ours(setup: Setup, scheme: str, mode: str, batch: int) -> Row:
    setup.free()
    model = our_model(setup, scheme)
    onednn_linears(model)  # as sample.py does
    compiled = mode == "compiled"
    if compiled:
        torch._dynamo.reset()  # this row's compile is its own, and no earlier model counts towards recompile limits
        compile_for_decoding(model)
    idx = setup.prompt(batch)
    graphs_before = counters["stats"]["unique_graphs"]

    def decode() -> Iterator[torch.Tensor]:
        generator = torch.Generator(device=setup.device).manual_seed(SEED)
        return stream(model, idx, setup.tokens, setup.args.temperature, setup.args.top_k or None, generator=generator)

    warmup = setup.time_tokens(itertools.islice(decode(), WARMUP_TOKENS))[1]  # the run's cache size
    setup.reset_peak()
    first, total = setup.time_tokens(decode())
    graphs = counters["stats"]["unique_graphs"] - graphs_before if compiled else None
    return Row("posgpt", scheme, mode, batch, batch * setup.tokens / total, 1000 * first,
               warmup if compiled else None, setup.peak_mib(), graphs)  # fmt: skip


def run_nanogpt(setup: Setup, batch: int) -> Row:
    """nanoGPT's GPT with learned positions (`peer_model`), timed through its `generate`."""
    args = setup.args
    setup.free()
    model = setup.peer_model(SHAPES[setup.shape], SEED).to(dtype=setup.dtype).eval()
    idx = setup.prompt(batch)
    greedy = args.temperature == 0  # its generate divides by the temperature: top_k 1 is its greedy
    temperature, top_k = (1.0, 1) if greedy else (args.temperature, args.top_k or None)

    @torch.no_grad()
    def generate(n: int) -> Iterator[torch.Tensor]:  # its generate yields nothing before the end
        yield model.generate(idx, n, temperature=temperature, top_k=top_k)

    return timed_generate(setup, "nanoGPT", batch, generate)


def run_hf(setup: Setup, batch: int) -> Row:
    """Hugging Face's GPT-2 `generate` (transformers), eager, on the weights of our learned row (its biases zero:
    ours has none), greedy or sampled as ours."""
    from transformers import GPT2Config, GPT2LMHeadModel

    ours = our_model(setup, "learned").state_dict()  # our learned row's weights
    c = GPTConfig(**SHAPES[setup.shape])
    hf_config = GPT2Config(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, n_positions=c.block_size,
                           vocab_size=ours["wte.weight"].size(0), activation_function="gelu")  # fmt: skip
    setup.free()
    with setup.device:
        model = GPT2LMHeadModel(hf_config).to(dtype=setup.dtype).eval()
    with torch.no_grad():
        for name, tensor in model.transformer.state_dict().items():  # h.LAYER.MODULE.KIND, or wte, wpe, ln_f
            layer, _, inner = name.removeprefix("h.").partition(".") if name.startswith("h.") else ("", "", name)
            module, _, kind = inner.rpartition(".")
            mine = ours.get(f"blocks.{layer}.{NAMES[module]}.{kind}" if layer else name.replace("wpe", "pe.table"))
            tensor.copy_(0 if mine is None else mine.t() if inner in TRANSPOSED else mine)
    idx, args = setup.prompt(batch), setup.args
    sampled = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k}  # top_k 0: all, as ours
    sampling = sampled if args.temperature else {"do_sample": False}

    @torch.no_grad()
    def generate(n: int) -> Iterator[torch.Tensor]:  # its generate yields nothing before the end
        yield model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, **sampling)  # fmt: skip

    return timed_generate(setup, "Hugging Face", batch, generate)


def timed_generate(setup: Setup, model: str, batch: int, generate: Callable[[int], Iterator[torch.Tensor]]) -> Row:
    """A peer's row: its `generate(n)`, which yields once at the end, warmed up, then timed for 1 and all tokens."""
    setup.time_tokens(generate(WARMUP_TOKENS))
    setup.reset_peak()
    first, total = setup.time_tokens(generate(1))[1], setup.time_tokens(generate(setup.tokens))[1]
    return Row(model, "learned", "eager", batch, batch * setup.tokens / total, 1000 * first, None, setup.peak_mib())


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
        columns = [[cell(getattr(r, name) if r else None, fmt) for r in got] for name, fmt in FIGURES.items()]
        lines.append(table_line([*key, *columns[0], *(" / ".join(c) for c in columns[1:])]))  # tokens/s: one per batch
    return lines


def bench_decode(args: DecodeBenchConfig) -> None:
    setup = Setup(args)
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top_k {args.top_k or 'all'}"
    print(f"{setup.name}, {setup.dtype_name}, torch {torch.__version__}; shape {setup.shape} {SHAPES[setup.shape]}, "
          f"no biases; prompt {args.prompt_tokens} tokens, {setup.tokens} new tokens, {sampling}")  # fmt: skip
    setup.load_peer(args.peer)
    head = ["model", "scheme", "mode", "batch", "tokens/s", "first token ms", "compile s", setup.memory_label, "graphs"]
    print("\n".join(table_head(head)), flush=True)
    ours = (run_ours(setup, *key) for key in itertools.product(args.schemes, args.modes, args.batches))
    nanogpt = (run_nanogpt(setup, batch) for batch in (args.batches if setup.peer is not None else []))
    hf = (run_hf(setup, batch) for batch in (args.batches if "learned" in args.schemes and args.hf else []))
    if args.hf and not find_spec("transformers"):
        print("note: transformers is not installed: no Hugging Face rows (pip install transformers)")
    for row in itertools.chain(ours, nanogpt, hf if find_spec("transformers") else []):
        figures = [cell(getattr(row, name), fmt) for name, fmt in FIGURES.items()]
        line = table_line([row.model, row.scheme, row.mode, str(row.batch), *figures])
        setup.add(row, line, {"dtype": setup.dtype_name, "shape": setup.shape, **SHAPES[setup.shape],
                  "prompt_tokens": args.prompt_tokens, "new_tokens": setup.tokens, "temperature": args.temperature,
                  "top_k": args.top_k, **asdict(row)})  # fmt: skip
    print(f"\nSummary (peak MiB: {setup.memory}; nanoGPT: its generate, no KV cache):")
    print("\n".join(summary(setup.rows, args.batches)))


COMMAND = Command("bench.py decode", DecodeBenchConfig, bench_decode, DecodeBenchConfig.__doc__, logs=False)
