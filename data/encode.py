"""Sources -> one flat file of token ids, streamed, with progress. GPT-2 BPE encodes batches of about
CHUNK_CHARS characters per thread on every core while the next batch is read (`GPT2Tokenizer.encode_pieces`);
<|endoftext|> follows every document. The char tokenizer encodes the same stream, a newline ending each
document of JSON lines, Parquet and datasets. Memory holds a few batches, whatever the corpus size.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.readers import CHUNK_CHARS
from data.sources import Source
from data.tokenizer import GPT2Tokenizer, Tokenizer

log = logging.getLogger(__name__)

MAX_BATCH_PIECES = 65536  # most pieces (documents, for short ones) encoded in one call
LOG_SECONDS = 60.0  # interval of progress lines where the input's size is unknown (a Hub dataset)
QUIET_SECONDS = 5.0  # no progress lines before this: a small corpus is done by then


class Progress:
    """How far a pass over the sources is: a tqdm bar on a terminal, else an INFO line every tenth (or minute)."""

    def __init__(self, what: str, total: int | None, interactive: bool | None = None) -> None:
        self.what, self.total = what, total or None
        self.read, self.tokens = 0, 0
        self.start = self._last_log = time.perf_counter()
        self.end: float | None = None
        self._tenth = 0
        interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc=what, leave=False) if interactive else None

    def update(self, read: int, tokens: int) -> None:
        """The input is read up to byte `read` and `tokens` are written."""
        if self.bar is not None:
            self.bar.update(read - self.read)
            self.bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
        self.read, self.tokens = read, tokens
        if self.bar is None:
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self.start < QUIET_SECONDS:
            return
        if self.total:
            tenth = min(10, self.read * 10 // self.total)
            if tenth <= self._tenth:
                return
            self._tenth = tenth
            where = f"{tenth * 10}% ({self.read / 1e6:.1f} of {self.total / 1e6:.1f} MB read"
        elif now - self._last_log >= LOG_SECONDS:
            where = f"{self.read / 1e6:.1f} MB read ("
        else:
            return
        self._last_log = now
        tokens = f", {self.tokens:,} tokens" if self.tokens else ""
        log.info("%s: %s%s, %.1f MB/s)", self.what, where, tokens, self.mb_per_s())

    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def mb_per_s(self) -> float:
        return self.read / 1e6 / max(self.seconds(), 1e-9)

    def record(self) -> dict[str, float]:
        return {"bytes": self.read, "seconds": round(self.seconds(), 2), "MB/s": round(self.mb_per_s(), 1)}

    def close(self) -> None:
        self.end = time.perf_counter()
        if self.bar is not None:
            self.bar.close()


def total_size(sources: list[Source]) -> int | None:
    """Bytes of all the sources, or None where one's size is unknown (a Hub dataset)."""
    sizes = [source.size() for source in sources]
    return None if None in sizes else sum(sizes)


def char_set(sources: list[Source], errors: str) -> set[str]:
    """The characters of the whole stream (the char tokenizer's vocabulary): a first pass over the sources."""
    chars: set[str] = set()
    progress = Progress("reading characters", total_size(sources))
    try:
        for text, read, _ in _char_stream(sources, errors):
            chars.update(text)
            progress.update(read, 0)
    finally:
        progress.close()
    return chars


def write_tokens(
    path: Path, sources: list[Source], tok: Tokenizer, dtype: np.dtype, errors: str, workers: int
) -> tuple[int, int, Progress]:
    """Encode every source into one flat token file at `path`: the tokens, the characters of text read
    (separators and <|endoftext|> not counted) and the finished progress."""
    progress = Progress("tokenizing", total_size(sources))
    tokens, chars = 0, 0
    pool = ThreadPoolExecutor(workers) if isinstance(tok, GPT2Tokenizer) and workers > 1 else None
    if isinstance(tok, GPT2Tokenizer):
        batches = _bpe_batches(sources, tok, errors, workers, pool)
    else:
        batches = _char_batches(sources, tok, errors)
    try:
        with open(path, "wb") as f:
            for ids, read, n_chars in batches:
                array = np.asarray(ids, dtype=dtype)
                f.write(array.tobytes())
                tokens, chars = tokens + array.size, chars + n_chars
                progress.update(read, tokens)
    finally:
        progress.close()
        if pool is not None:
            pool.shutdown()
    return tokens, chars, progress


def _bpe_batches(
    sources: list[Source], tok: GPT2Tokenizer, errors: str, workers: int, pool: ThreadPoolExecutor | None
) -> Iterator[tuple[np.ndarray, int, int]]:
    """(ids, bytes read so far, characters) for each batch of pieces, <|endoftext|> after each document. A
    batch is encoded while the next one is read (reading JSON holds the GIL, encoding mostly does not)."""
    pending: deque[tuple[Future, int, int]] = deque()
    with ThreadPoolExecutor(1) as driver:
        for texts, ends, read, size in _piece_batches(sources, errors, workers):
            pending.append((driver.submit(tok.encode_pieces, texts, ends, workers, pool), read, size))
            if len(pending) > 1:
                future, done, chars = pending.popleft()
                yield future.result(), done, chars
        while pending:
            future, done, chars = pending.popleft()
            yield future.result(), done, chars


def _piece_batches(
    sources: list[Source], errors: str, workers: int
) -> Iterator[tuple[list[str], list[bool], int, int]]:
    """(texts, ends, bytes read so far, characters): about CHUNK_CHARS characters per worker at a time."""
    texts: list[str] = []
    ends: list[bool] = []
    size, base, read = 0, 0, 0
    for source in sources:
        for piece in source.pieces(errors):
            texts.append(piece.text)
            ends.append(piece.end)
            size += len(piece.text)
            read = base + piece.read
            if size >= workers * CHUNK_CHARS or len(texts) >= MAX_BATCH_PIECES:
                yield texts, ends, read, size
                texts, ends, size = [], [], 0
        base = read
    if texts:
        yield texts, ends, read, size


def _char_batches(sources: list[Source], tok: Tokenizer, errors: str) -> Iterator[tuple[list[int], int, int]]:
    """(ids, bytes read so far, characters) for about CHUNK_CHARS characters at a time."""
    parts: list[str] = []
    size, chars, read = 0, 0, 0
    for text, read, n_chars in _char_stream(sources, errors):
        parts.append(text)
        size, chars = size + len(text), chars + n_chars
        if size >= CHUNK_CHARS:
            yield tok.encode("".join(parts)), read, chars
            parts, size, chars = [], 0, 0
    if parts:
        yield tok.encode("".join(parts)), read, chars


def _char_stream(sources: list[Source], errors: str) -> Iterator[tuple[str, int, int]]:
    """The char tokenizer's text: (text, bytes read so far, characters of the sources' own text in it)."""
    base, read = 0, 0
    for source in sources:
        separator = "" if source.format == "text" else "\n"
        for piece in source.pieces(errors):
            read = base + piece.read
            text = piece.text + separator if piece.end else piece.text
            yield text, read, len(piece.text)
        base = read
