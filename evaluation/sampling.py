"""Sampling from a trained checkpoint: the logic behind `sample.py`.

The checkpoint alone rebuilds model and tokenizer. Text goes to stdout (streamed token by token
for one sample in a terminal); speed goes to stderr, so stdout can be piped.
"""

from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from core.device import pick_device_dtype
from data.errors import DataError
from data.tokenizer import CharTokenizer, Tokenizer
from evaluation.checkpoint import load_checkpoint
from model.generation import stream


@dataclass
class SampleConfig:
    """What to sample from which checkpoint, and how."""

    ckpt: str
    """Checkpoint written by train.py."""
    prompt: str = ""
    """Text to continue, or @FILE to read it from a file (default: empty, the tokenizer's start token)."""
    prompt_file: str | None = None
    """Read the prompt from this file."""
    num_samples: int = 1
    """Samples of the prompt, generated as one batch."""
    max_new_tokens: int = 500
    """Tokens to generate per sample."""
    temperature: float = 0.8
    """Softmax temperature: 0 is greedy, higher flattens the distribution."""
    top_k: int = 200
    """Sample among the k most likely tokens (0: all)."""
    top_p: float | None = None
    """Nucleus sampling: the most likely tokens up to probability mass p, in (0, 1]; the most likely
    token is always kept."""
    seed: int = 1337
    """Same seed, same output."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations: auto is bfloat16 on a GPU that has it, else float32."""
    no_cache: bool = False
    """Recompute the whole context for every token instead of keeping keys and values (to compare)."""
    max_context: int | None = None
    """Context window of the schemes that extrapolate (default: 4 x block_size)."""
    stream: bool | None = None
    """Print tokens as they come (default: on for one sample in a terminal)."""
    compile: bool = False
    """torch.compile the model."""
    drop_unknown: bool = False
    """Drop prompt characters outside a char-level vocabulary instead of stopping."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline GPT-2 BPE (or set POSGPT_TIKTOKEN_RANKS)."""

    def __post_init__(self) -> None:
        for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0)):
            value = getattr(self, name)
            if value < low:
                raise ValueError(f"--{name} must be at least {low}, got {value}.")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}.")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"--max_context must be at least 1, got {self.max_context}.")
        if self.prompt_file and self.prompt:
            raise ValueError("Pass either --prompt or --prompt_file, not both.")
        pick_device_dtype(self.device, self.dtype)  # a device this machine has


def prompt_text(prompt: str, prompt_file: str | None = None) -> str:
    """The prompt: `prompt` itself, or the text of `prompt_file` or of @FILE."""
    source = prompt_file or (prompt[1:] if prompt.startswith("@") else None)
    if source is None:
        return prompt
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"Cannot read the prompt file {source}: {error}") from None


def encode_prompt(tokenizer: Tokenizer, text: str, drop_unknown: bool) -> list[int]:
    if not text:
        return tokenizer.start_ids()
    ids = tokenizer.encode(text, drop_unknown) if isinstance(tokenizer, CharTokenizer) else tokenizer.encode(text)
    return ids or tokenizer.start_ids()


def sample(args: SampleConfig) -> None:
    """Generate as `args` says: text to stdout, speed to stderr."""
    ckpt = load_checkpoint(args.ckpt, args.tiktoken_ranks)
    text = prompt_text(args.prompt, args.prompt_file)
    prompt = encode_prompt(ckpt.tokenizer, text, args.drop_unknown)
    device, dtype = pick_device_dtype(args.device, args.dtype)
    model = ckpt.model.to(device=device, dtype=dtype).eval()
    if args.compile:
        model.compile(dynamic=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=device)
    live = args.stream if args.stream is not None else (args.num_samples == 1 and sys.stdout.isatty())
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if live:
        sys.stdout.write(ckpt.tokenizer.decode(prompt) if text else "")
    start = time.perf_counter()
    new_tokens: list[torch.Tensor] = []
    for token in stream(model, idx, args.max_new_tokens, args.temperature, args.top_k or None, args.top_p,
                        not args.no_cache, args.max_context, generator):  # fmt: skip
        new_tokens.append(token)
        if live:
            sys.stdout.write(decoder.decode(ckpt.tokenizer.decode_bytes([token[0, 0].item()])))
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    if live:
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    else:
        out = torch.cat([idx, *new_tokens], dim=1).tolist()
        for i, row in enumerate(out):
            text = ckpt.tokenizer.decode(row)
            sys.stdout.write(text + ("\n---------------\n" if i < len(out) - 1 else "\n"))
    total = args.max_new_tokens * args.num_samples
    cache = "no cache" if args.no_cache else "kv cache"
    print(f"{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s ({cache}, {device}, {dtype})",
          file=sys.stderr)  # fmt: skip
