"""`sample.py`: every prompt, `--num_samples` times, is one row of one batch; each row stops at its own
end-of-text token or `--stop` string. Text goes to stdout, speed to stderr, so stdout can be piped. Each
mistake in a prompt stops with one message that names it (`Prompt.where`): in a file of a hundred, "the
prompt" says nothing.
"""

from __future__ import annotations

import codecs
import functools
import itertools
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from posgpt.core.cli import Command
from posgpt.core.device import pick_device_dtype
from posgpt.core.errors import ConfigError
from posgpt.core.threads import revisit
from posgpt.data.errors import DataError
from posgpt.data.tokenizer import Tokenizer
from posgpt.evaluation.checkpoint import load_checkpoint
from posgpt.model.cache import KVCache
from posgpt.model.generation import compile_for_decoding, context_window, pad_prompts, stream
from posgpt.model.gpt import GPT
from posgpt.model.linear import onednn_linears

SEPARATOR = "\n---------------\n"
WARM_UP_TOKENS = 3
"""Tokens of the untimed compiling run: the prompt's graph, then the one-token step twice (a CUDA graph
is recorded on its second call)."""
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
SHOWN_CHARS = 40
"""How much of a prompt a message quotes."""


@dataclass
class SampleConfig:
    """What to sample from which checkpoint, and how."""

    ckpt: str
    """Checkpoint written by train.py."""
    prompt: str = ""
    """Text to continue, or @FILE to read it from a file (default: empty, the tokenizer's start token)."""
    prompt_file: str | None = None
    """Read the prompt from this file (the whole file is one prompt)."""
    prompts_file: str | None = None
    """A file of prompts, one per line, all generated in one batch (each --num_samples times)."""
    num_samples: int = 1
    """Samples of each prompt, generated as one batch."""
    max_new_tokens: int = 500
    """Tokens to generate per sample, at most."""
    stop: str | None = None
    """End a sample at this text, left out (\\n, \\t, \\r and \\\\ as in Python), or at the end-of-text token."""
    temperature: float = 0.8
    """Softmax temperature: 0 is greedy, higher flattens the distribution."""
    top_k: int = 200
    """Sample among the k most likely tokens (0: all)."""
    top_p: float | None = None
    """Nucleus sampling: the most likely tokens up to probability mass p, in (0, 1] (at least one)."""
    seed: int = 1337
    """Same seed, same output."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations: auto is bfloat16 on a GPU that has it, else float32."""
    no_cache: bool = False
    """Recompute the whole context for every token instead of keeping keys and values (to compare)."""
    max_context: int | None = None
    """Context window of the schemes that extrapolate (default: block_size, the training length, as nanoGPT's)."""
    stream: bool | None = None
    """Print tokens as they come, for one sample (default: on for one sample in a terminal)."""
    compile: bool = False
    """Compile the model for decoding (static shapes; CUDA graphs on a GPU); the compile time is reported apart."""
    drop_unknown: bool = False
    """Drop prompt characters outside a char-level vocabulary instead of stopping."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline GPT-2 BPE (or set POSGPT_TIKTOKEN_RANKS)."""

    def __post_init__(self) -> None:
        for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0), ("max_context", 1)):
            value = getattr(self, name)
            if value is not None and value < low:  # max_context None: block_size
                raise ValueError(f"--{name} must be at least {low}, got {value}.")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}.")
        if self.prompt_file and self.prompt:
            raise ValueError("Pass either --prompt or --prompt_file, not both.")
        if self.prompts_file is not None and (self.prompt or self.prompt_file):
            raise ValueError("Pass either --prompts_file (one prompt per line) or --prompt / --prompt_file, not both.")
        if self.stop == "":
            raise ValueError("--stop must not be empty; leave it out to stop at the end of text only.")
        if self.stream and self.num_samples > 1:
            raise ValueError("--stream true prints one sample as it comes; leave it out with --num_samples > 1.")
        pick_device_dtype(self.device, self.dtype)  # a device this machine has


def stop_text(stop: str | None) -> str | None:
    """`--stop` with \\n, \\t, \\r and \\\\ read as in Python (a shell passes `--stop "\\n\\n"` as backslashes)."""
    return None if stop is None else re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], stop)


@dataclass(frozen=True)
class Prompt:
    """One prompt as the user gave it and as the model reads it."""

    where: str
    """How messages name it: `--prompt`, `line 3 of --prompts_file p.txt`."""
    text: str
    ids: list[int]
    """Uncropped: the output shows the whole prompt even where the model sees its end only."""


def prompt_text(prompt: str, prompt_file: str | None = None) -> str:
    """The prompt: `prompt` itself, or the text of `prompt_file` or of @FILE."""
    source = prompt_file or (prompt[1:] if prompt.startswith("@") else None)
    if source is None:
        return prompt
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"Cannot read the prompt file {source}: {error}") from None


def read_prompts(tokenizer: Tokenizer, args: SampleConfig) -> list[Prompt]:
    """Every prompt of the run, read and encoded, in order. An empty one is the tokenizer's start token, but one of
    which `--drop_unknown` leaves nothing is refused (the model would continue something the user did not write)."""
    if args.prompts_file is not None:  # empty lines refused, not skipped: that would change which row is which line
        option = f"--prompts_file {args.prompts_file}"
        try:
            lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise DataError(f"{option}: no such file.") from None
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"{option}: cannot read it ({error}).") from None
        if not lines:
            raise DataError(f"{option} is empty: write one prompt per line.")
        if empty := [n for n, line in enumerate(lines, 1) if not line]:
            raise DataError(f"{option}: line {empty[0]} is empty; write one prompt per line, with no empty lines.")
        sources = [(f"line {n} of {option}", line) for n, line in enumerate(lines, 1)]
    else:
        where = f"--prompt_file {args.prompt_file}" if args.prompt_file else "--prompt"
        sources = [(where, prompt_text(args.prompt, args.prompt_file))]
    prompts = []
    for where, text in sources:
        try:
            ids = tokenizer.encode(text, args.drop_unknown)
        except DataError as error:
            raise DataError(f"{where}: {error}") from None
        if text and not ids:
            raise DataError(
                f"{where} ({text[:SHOWN_CHARS]!r}): none of its characters is in the model's vocabulary, so "
                "--drop_unknown leaves nothing to continue; give it characters of the training text."
            )
        prompts.append(Prompt(where, text, ids or tokenizer.start_ids()))
    return prompts


def crop(prompts: list[Prompt], max_positions: int | None, limit: str = "the model's {} positions") -> list[list[int]]:
    """The tokens the model reads of each prompt: the last `max_positions` of a longer one (learned positions
    end there, and `--max_context` for the other schemes; nanoGPT crops the same way), said in one line on stderr
    naming the `limit`."""
    if max_positions is None:
        return [p.ids for p in prompts]
    if long := [p for p in prompts if len(p.ids) > max_positions]:
        names = ", ".join(p.where for p in long[:3]) + (f" and {len(long) - 3} more" if len(long) > 3 else "")
        tokens = max(len(p.ids) for p in long)
        print(
            f"{names}: {'up to ' if len(long) > 1 else ''}{tokens} tokens, more than {limit.format(max_positions)}; "
            f"{'each continues' if len(long) > 1 else 'it continues'} from its last {max_positions} tokens.",
            file=sys.stderr,
        )
    return [p.ids[-max_positions:] for p in prompts]


class Rows:
    """Each row's continuation as text, cut before its end-of-text token or its first `stop` string; fed one
    step of tokens at a time, so a stopped row is known at once."""

    def __init__(self, count: int, tokenizer: Tokenizer, stop: str | None, end: int | None) -> None:
        self.tokenizer, self.stop, self.end = tokenizer, stop, end
        self.texts, self.done = [""] * count, [False] * count
        self.tokens = 0  # new tokens of rows still running when drawn (what tokens/s counts)
        self.printed = 0  # characters of row 0 printed live
        # a BPE token can hold part of a character: decode each row's bytes incrementally
        self._decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(count)]

    def add(self, step: list[int]) -> None:
        """One new token per row."""
        for row, token in enumerate(step):
            if self.done[row]:
                continue
            self.tokens += 1
            if token == self.end:
                self.done[row] = True
            else:
                self._extend(row, self._decoders[row].decode(self.tokenizer.decode_bytes([token])))

    def finish(self) -> None:
        """The bytes still held by the decoders of rows that ran to --max_new_tokens."""
        for row, decoder in enumerate(self._decoders):
            if not self.done[row]:
                self._extend(row, decoder.decode(b"", final=True))

    def shown(self, row: int) -> str:
        """What may be printed of a running row: all but a tail that may be the start of the stop string."""
        text = self.texts[row]
        if self.done[row] or not self.stop:
            return text
        held = next((k for k in range(min(len(self.stop) - 1, len(text)), 0, -1) if text.endswith(self.stop[:k])), 0)
        return text[: len(text) - held]

    def _extend(self, row: int, new: str) -> None:
        before = len(self.texts[row])
        self.texts[row] += new
        if self.stop is not None:
            at = self.texts[row].find(self.stop, max(0, before - len(self.stop) + 1))  # a stop may span tokens
            if at >= 0:
                self.texts[row], self.done[row] = self.texts[row][:at], True


def generate_rows(steps: Iterator[torch.Tensor], rows: Rows, live: bool) -> tuple[float, float]:
    """Generate into `rows` until every row has stopped; (seconds, seconds to the first token). Steps are
    read as they come (a copy that waits for the device) only where a row can stop or is shown live."""
    start, first = time.perf_counter(), 0.0
    kept: list[torch.Tensor] = []
    for i, token in enumerate(steps):
        revisit()
        if rows.stop is not None or rows.end is not None or live:
            rows.add(token[:, 0].tolist())
            if live:  # row 0 printed as it comes (one sample in a terminal), never past where it may stop
                text = rows.shown(0)
                print(text[rows.printed :], end="", flush=True)
                rows.printed = max(rows.printed, len(text))
        else:
            kept.append(token)
            if i == 0:
                token.cpu()  # wait for the first one, to time it
        if i == 0:
            first = time.perf_counter() - start
        if all(rows.done):
            break
    for step in torch.cat(kept, dim=1).t().tolist() if kept else []:
        rows.add(step)
    return time.perf_counter() - start, first


def cache_in_words(model: GPT) -> str:
    """What decoding keeps per layer: 'kv cache: every key, 4 KV heads', or per kind of a layout
    'kv cache: local x5 16 keys, global x1 every key, 2 KV heads' (a rolling kind keeps its window and sinks or
    its chunk), a running state's 'constant state' (linear attention, the delta rules), or both in a hybrid
    ('kv cache: attn x1 every key, 2 KV heads; constant state: gdn x3')."""
    held, states = [], []
    for kind in model.kinds:
        part = kind.attention.new_cache(kind.config, kind.mask, 0, len(kind.layers))  # nothing allocated
        name = f"{kind.name} x{len(kind.layers)}" if model.config.layout else ""  # a layout's kinds are named
        if isinstance(part, KVCache):
            held.append(" ".join(filter(None, [name, f"{part.capacity} keys" if part.rolling else "every key"])))
        else:
            states.append(name)
    heads, words = model.config.kv_heads, []
    if held:
        words.append(f"kv cache: {', '.join(held)}, {heads} KV head{'s' * (heads > 1)}")
    if states:
        words.append(f"constant state: {', '.join(states)}" if any(states) else "constant state")
    return "; ".join(words)


def sample(args: SampleConfig) -> None:
    """Generate as `args` says: text to stdout, speed to stderr."""
    ckpt = load_checkpoint(args.ckpt, args.tiktoken_ranks)
    prompts = read_prompts(ckpt.tokenizer, args)
    if args.stream and len(prompts) > 1:
        raise ConfigError("--stream true prints one sample as it comes; leave it out with --prompts_file.")
    device, dtype = pick_device_dtype(args.device, args.dtype)
    model = ckpt.model.to(device=device, dtype=dtype).eval()
    onednn_linears(model)  # where this CPU runs them faster; float32 eager only
    window, learned = context_window(model, args.max_context), model.pe.max_positions
    limit = "the model's {} positions" if window == learned else "--max_context {} (default block_size)"
    batch, lengths = pad_prompts([ids for ids in crop(prompts, window, limit) for _ in range(args.num_samples)], device)
    steps = functools.partial(stream, model, batch, args.max_new_tokens, args.temperature, args.top_k or None,
                              args.top_p, not args.no_cache, args.max_context, lengths=lengths)  # fmt: skip
    compiled = None  # seconds to compile
    if args.compile:  # the first tokens of the timed run's stream trace the graphs it uses, so its clock counts
        compile_for_decoding(model)  # decoding only; the warm-up's own generator leaves the run's draws as they are
        start = time.perf_counter()
        warm_up = steps(torch.Generator(device=device).manual_seed(args.seed))
        list(itertools.islice(warm_up, WARM_UP_TOKENS))[-1].cpu()  # the run's cache size; wait for the device
        compiled = time.perf_counter() - start
    rows = Rows(batch.size(0), ckpt.tokenizer, stop_text(args.stop), ckpt.tokenizer.end_id)
    heads = [ckpt.tokenizer.decode(p.ids) for p in prompts for _ in range(args.num_samples)]
    live = args.stream if args.stream is not None else (len(heads) == 1 and sys.stdout.isatty())
    if live:
        sys.stdout.write(heads[0] if prompts[0].text else "")
    seconds, first = generate_rows(steps(torch.Generator(device=device).manual_seed(args.seed)), rows, live)
    rows.finish()
    if live:
        sys.stdout.write(rows.texts[0][rows.printed :] + "\n")
    else:  # each row's prompt and continuation, between separator lines
        sys.stdout.write(SEPARATOR.join(head + text for head, text in zip(heads, rows.texts, strict=True)) + "\n")
    cache = "no cache" if args.no_cache else cache_in_words(model)
    compile_time = f"; compile {compiled:.1f} s" if compiled is not None else ""
    rate = rows.tokens / max(seconds, 1e-9)  # tokens of rows still running
    print(f"{rows.tokens} tokens in {seconds:.2f} s: {rate:.1f} tokens/s, first token {first * 1000:.0f} ms "
          f"({cache}, {device}, {dtype}{compile_time})", file=sys.stderr)  # fmt: skip


def sample_main(cfg: SampleConfig) -> None:
    """Sample; a reader that closes the pipe (`... | head`) has what it wanted, which is no error."""
    try:
        sample(cfg)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush into the pipe


COMMAND = Command(
    "sample.py",
    SampleConfig,
    sample_main,
    "Sample from a trained checkpoint: --ckpt runs/NAME/last.ckpt --prompt 'ROMEO:'. The checkpoint alone "
    "rebuilds model and tokenizer; text goes to stdout (streamed for one sample in a terminal), speed to stderr.",
    logs=False,
)
