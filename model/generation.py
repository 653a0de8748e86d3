"""Autoregressive sampling with a static KV cache, for every position scheme, in batches of prompts
of any lengths: a prefill of every row's prompt (padded on the right to a power of two, so few
widths), then a decode step of one token per row at its own position, each with fixed shapes (one
compiled graph each, the pick of the next token in it; on a GPU the decode step is a CUDA graph).

A model sees at most its last `window` tokens: `block_size` for `learned` positions, `max_context` (default
block_size, the length it trained at, as nanoGPT and litgpt crop) for the schemes that extrapolate. Once the longest
row fills the window, every step is a prefill of each row's last `window` tokens, exactly what the uncached path
sees, so both give the same tokens. A sliding-window model whose scheme extrapolates has no such limit (its rolling
cache stays constant) unless `max_context` asks for one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from posgpt.model.cache import DecodingCache

if TYPE_CHECKING:
    from posgpt.model.gpt import GPT


def context_window(model: GPT, max_context: int | None = None) -> int | None:
    """How many of the last tokens the model sees when generating (see the module docstring);
    None: all of them (a sliding-window model whose scheme extrapolates)."""
    learned = model.pe.max_positions
    if learned is None and max_context is None and model.constant_memory():
        return None
    limit = max_context or model.config.block_size  # the default for the schemes that extrapolate
    return limit if learned is None else min(limit, learned)


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Logits (B, V) with every token outside the top_k most likely, or outside the smallest set whose
    probabilities sum to at least top_p (nucleus sampling), set to -inf; the most likely token is kept."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
        drop_sorted = before >= top_p  # the first token always has 0 above it: always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> Tensor:
    """(B, V) logits -> (B, 1) token ids: argmax for temperature 0, else a filtered sample drawn by `generator`,
    or, given `noise` (B, V) of Exponential(1) draws, the exponential race: the argmax of p / noise, which is
    token i with probability p_i (what a compiled step draws with: Dynamo traces no generator)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    if noise is not None:
        return (probs / noise).argmax(dim=-1, keepdim=True)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def hashed_noise(seed: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """(B, vocab) Exponential(1) draws, each a hash of (seed, row, position, token id): no generator state, so a
    compiled step draws them inside its graph, the same for a seed on any device."""
    rows = torch.arange(positions.size(0), device=positions.device)
    key = _mix(_mix(_mix(seed ^ rows) ^ positions)[:, None] ^ torch.arange(vocab, device=positions.device))
    return -torch.log(((key >> 9).float() + 0.5) / 2**23)  # in (0, 1): 23 bits + 0.5 are exact in float32


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (the shape of Wellons' lowbias32), its multipliers under 2^31: no int64 overflow."""
    x = (x ^ (x >> 16)) * 0x7FEB352D & 0xFFFFFFFF
    x = (x ^ (x >> 15)) * 0x5BD1E995 & 0xFFFFFFFF
    return x ^ (x >> 16)


def pad_prompts(prompts: list[list[int]], device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """Prompts of any lengths (at least one token each) as one batch: (B, T) ids, each row padded on
    the right to the longest (with token 0, which no real token attends to), and (B,) lengths."""
    longest = max(len(p) for p in prompts)
    idx = torch.tensor([p + [0] * (longest - len(p)) for p in prompts], dtype=torch.long, device=device)
    return idx, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)


def compile_for_decoding(model: nn.Module, backend: str | Callable = "inductor") -> None:
    """Compile `model`'s step for `stream` in place: its forward pass and the pick of the next token in one graph
    (a prefill's and a decode step's), static shapes, and on CUDA CUDA graphs (reduce-overhead)."""
    cuda = next(model.parameters()).device.type == "cuda" and backend == "inductor"
    model.advance = torch.compile(_advance, backend=backend, dynamic=False, mode="reduce-overhead" if cuda else None)


def stream(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    max_context: int | None = None,
    generator: torch.Generator | None = None,
    lengths: Tensor | None = None,
) -> Iterator[Tensor]:
    """Yield `max_new_tokens` new tokens, each (B, 1), continuing every row of `idx` (B, T).

    Args:
        model: the GPT, in eval mode.
        idx: prompts, at least one token each.
        temperature: 0 is greedy; higher flattens the distribution.
        top_k, top_p: restrict sampling (see `filter_logits`).
        use_cache: keep keys and values instead of recomputing the context for every token.
        max_context: window of the extrapolating schemes (see the module docstring).
        generator: random generator, for reproducible samples.
        lengths: (B,) tokens of each row of `idx` that are its prompt (the rest is padding on the
            right, see `pad_prompts`); None: every row is all prompt.

    Every row goes on until the caller stops iterating (each row's own stop is the caller's).
    """
    seed = None  # a compiled step's, drawn once from the generator (eager draws keep to it alone)
    if hasattr(model, "advance"):
        device = idx.device if generator is None else generator.device
        seed = torch.randint(2**31, (1,), device=device, generator=generator).to(idx.device)

    def pick(logits: Tensor, count: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # inside the graph: the seed's draws for each row's position
            return next_token(logits, temperature, top_k, top_p, noise=hashed_noise(seed, count, logits.size(-1)))
        return next_token(logits, temperature, top_k, top_p, generator)

    yield from (token for _, token in decode(model, idx, max_new_tokens, pick, use_cache, max_context, lengths))


def decode(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    pick: Callable[[Tensor, Tensor], Tensor],
    use_cache: bool = True,
    max_context: int | None = None,
    lengths: Tensor | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """`stream`'s loop: yield each step's logits (B, vocab_size) and the tokens (B, 1) `pick(logits, count)` chose,
    count (B,) each row's tokens so far (the new one's position)."""
    B, T = idx.shape
    counts = lengths.tolist() if lengths is not None else [T] * B  # read once, then kept on the host
    if T == 0 or min(counts) < 1:
        raise ValueError("generate needs a prompt of at least one token (e.g. a newline or <|endoftext|>).")
    window = context_window(model, max_context)
    total = max(counts) + max_new_tokens
    tokens = torch.zeros(B, max(total, T), dtype=torch.long, device=idx.device)  # idx may be padded wider
    tokens[:, :T] = idx
    count = torch.tensor(counts, device=idx.device)  # each row's tokens so far
    longest = max(counts)  # every row grows by one token per step: the longest stays the longest
    cache = model.new_cache(_bucket(total, window), batch=B, longest=window or total) if use_cache else None
    advance = getattr(model, "advance", _advance)  # compiled by `compile_for_decoding`, or not

    def step(idx: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        logits, new = advance(model, idx, cache, count, pick, lengths)
        return (logits, new) if advance is _advance else (logits.clone(), new.clone())  # CUDA graphs reuse outputs

    with torch.no_grad():
        logits, new = step(*_window(tokens, count, longest, window))
        for i in range(max_new_tokens):
            yield logits, new
            if i == max_new_tokens - 1:
                break
            tokens.scatter_(1, count[:, None], new)
            count += 1
            longest += 1
            if cache is not None and (window is None or longest <= window):
                logits, new = step(new)  # the static decode step
            else:  # no cache, or a full one: every row's last `window` tokens from scratch
                if cache is not None:
                    cache.reset()
                logits, new = step(*_window(tokens, count, longest, window))


def _bucket(length: int, limit: int | None) -> int:
    """`length` rounded up to a power of two, at most `limit`: few widths for a compiled prefill."""
    width = 1 << (length - 1).bit_length()
    return width if limit is None else min(width, limit)


def _window(tokens: Tensor, count: Tensor, longest: int, window: int | None) -> tuple[Tensor, Tensor]:
    """A prefill's input: the last `window` of the first `count[b]` tokens of each row, as one batch padded on the
    right to a bucketed width, and each row's real length."""
    seen = torch.clamp(count, max=window) if window is not None else count
    width = _bucket(longest, window)  # few widths: few compiles (at most the window: _bucket caps it)
    index = ((count - seen)[:, None] + torch.arange(width, device=tokens.device)).clamp(max=tokens.size(1) - 1)
    return tokens.gather(1, index), seen


def _advance(
    model: GPT, idx: Tensor, cache: DecodingCache | None, count: Tensor, pick: Callable[[Tensor, Tensor], Tensor],
    lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One step: the float32 logits (B, vocab_size) after each row of `idx` (its first `lengths[b]`), added to the
    cache if any, and the tokens (B, 1) `pick` draws from them; the padded vocabulary cut off, so no token is an id
    the tokenizer lacks."""
    logits, _ = model(idx, cache=cache, last_only=True, lengths=lengths)
    logits = logits[:, -1, : model.config.vocab_size].float()
    return logits, pick(logits, count)
