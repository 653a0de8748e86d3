"""Sample from a trained checkpoint: `python sample.py --ckpt runs/NAME/last.ckpt --prompt "ROMEO:"`.

The checkpoint alone rebuilds model and tokenizer. Text goes to stdout (streamed token by token
for one sample in a terminal); speed goes to stderr, so stdout can be piped.
"""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from pathlib import Path

import torch

from core.checkpoint import CheckpointError, load_checkpoint
from core.device import pick_device_dtype
from data.errors import DataError
from data.tokenizer import CharTokenizer, Tokenizer
from model.generation import stream


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sample.py", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py")
    p.add_argument("--prompt", default="", help="text to continue, or @FILE to read it from a file (default: empty)")
    p.add_argument("--prompt_file", help="read the prompt from this file")
    p.add_argument("--num_samples", type=int, default=1, help="samples of the prompt, generated as one batch")
    p.add_argument("--max_new_tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling: the most likely tokens up to mass p")
    p.add_argument("--seed", type=int, default=1337, help="same seed, same output")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--no_cache", action="store_true", help="recompute the context for every token (to compare)")
    p.add_argument("--max_context", type=int, default=None, help="window for extrapolating schemes (4 x block_size)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print tokens as they come (default: on for one sample in a terminal)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--drop_unknown", action="store_true", help="drop prompt characters outside a char vocabulary")
    p.add_argument("--tiktoken_ranks", help="local r50k_base.tiktoken for offline GPT-2 BPE")
    return p


def read_prompt(args: argparse.Namespace) -> str:
    source = args.prompt_file or (args.prompt[1:] if args.prompt.startswith("@") else None)
    if source is None:
        return args.prompt
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"Cannot read the prompt file {source}: {error}") from None


def encode_prompt(tokenizer: Tokenizer, text: str, drop_unknown: bool) -> list[int]:
    if not text:
        return tokenizer.start_ids()
    ids = tokenizer.encode(text, drop_unknown) if isinstance(tokenizer, CharTokenizer) else tokenizer.encode(text)
    return ids or tokenizer.start_ids()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        ckpt = load_checkpoint(args.ckpt, args.tiktoken_ranks)
        text = read_prompt(args)
        prompt = encode_prompt(ckpt.tokenizer, text, args.drop_unknown)
        device, dtype = pick_device_dtype(args.device, args.dtype)
    except (CheckpointError, DataError, ValueError) as error:
        sys.exit(f"error: {error}")
    model = ckpt.model.to(device=device, dtype=dtype).eval()
    if args.compile:
        model.compile(dynamic=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=device)
    live = args.stream if args.stream is not None else (args.num_samples == 1 and sys.stdout.isatty())
    vocab = ckpt.tokenizer.vocab_size
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if live:
        sys.stdout.write(ckpt.tokenizer.decode(prompt) if text else "")
    start = time.perf_counter()
    new_tokens: list[torch.Tensor] = []
    for token in stream(model, idx, args.max_new_tokens, args.temperature, args.top_k or None, args.top_p,
                        not args.no_cache, args.max_context, generator):  # fmt: skip
        new_tokens.append(token)
        if live and token[0, 0].item() < vocab:
            sys.stdout.write(decoder.decode(ckpt.tokenizer.decode_bytes([token[0, 0].item()])))
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    if live:
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    else:
        out = torch.cat([idx, *new_tokens], dim=1).tolist()
        for i, row in enumerate(out):
            text = ckpt.tokenizer.decode([t for t in row if t < vocab])
            sys.stdout.write(text + ("\n---------------\n" if i < len(out) - 1 else "\n"))
    total = args.max_new_tokens * args.num_samples
    cache = "no cache" if args.no_cache else "kv cache"
    print(f"{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s ({cache}, {device}, {dtype})",
          file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # e.g. `python sample.py ... | head`: the reader has what it wanted
        sys.stderr.close()
