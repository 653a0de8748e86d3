"""Turn text into memory-mapped token files: `train.bin`, `val.bin` and `meta.json` (docs/data.md).

The sources are streamed into one flat token file, memory holding a few batches whatever the corpus size:
GPT-2 BPE encodes batches of about CHUNK_CHARS characters per thread on every core while the next batch is read
(`GPT2Tokenizer.encode_pieces`), <|endoftext|> after every document; the char tokenizer encodes the same
stream, a newline ending each document of JSON lines, Parquet and datasets.

The validation split is the last min(`val_fraction` of the tokens, `val_max_tokens`) tokens: deterministic
and contiguous, so no window straddles the two splits. `meta.json` is removed first and written last, so a
directory is trusted only when it is there; a directory lock serialises concurrent prepares of one output,
and a failed prepare leaves no token file, temporary file or lock file behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tqdm import tqdm

from posgpt.core.cli import Command
from posgpt.core.files import atomic_file, atomic_write_bytes, waiting_lock
from posgpt.data.corpora import NAMED
from posgpt.data.errors import DataError
from posgpt.data.readers import CHUNK_CHARS
from posgpt.data.sources import HUB_PREFIX, HUB_SYNTAX, Source, corpus_name, file_source, hub_source, path_sources
from posgpt.data.tokenizer import CharTokenizer, GPT2Tokenizer, Tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
VAL_MAX_TOKENS = 5_000_000
NAMES = ", ".join(NAMED)
MAX_BATCH_PIECES = 65536  # most pieces (documents, for short ones) encoded in one call
LOG_SECONDS = 60.0  # interval of progress lines where the input's size is unknown (a Hub dataset)
QUIET_SECONDS = 5.0  # no progress lines before this: a small corpus is done by then


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (GPT-2's 50257 does), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


Inputs = str | os.PathLike | Source | Sequence[str | os.PathLike | Source]


def resolve_sources(inputs: Inputs, glob: str = "*.txt", text_column: str = "text") -> list[Source]:
    """The sources to read, in a fixed order, without repeats (see `data.sources` for the syntax)."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike, Source)) else list(inputs)
    if not items:
        raise DataError(f"No input given: pass --data.input FILE|DIR|{HUB_SYNTAX} or a named corpus ({NAMES}).")
    found: dict[str, Source] = {}
    for item in items:
        text = str(item)
        if isinstance(item, Source):
            sources = [item]
        elif text in NAMED:
            named = NAMED[text]()
            sources = [named if isinstance(named, Source) else file_source(named, text_column)]
        elif text.startswith(HUB_PREFIX):
            sources = [hub_source(text, text_column)]
        elif (path := Path(item).expanduser()).exists():
            sources = path_sources(path, glob, text_column)
        else:
            raise DataError(
                f"Input not found: {path}. Pass an existing file or directory, a Hub dataset ({HUB_SYNTAX}) or a "
                f"named corpus ({NAMES})."
            )
        for source in sources:
            found.setdefault(source.location, source)
    return list(found.values())


@dataclass
class PrepareConfig:
    """What to tokenize, into which directory, how (`posgpt prepare`)."""

    inputs: str | list[str]
    """Text, JSON-lines (.jsonl, .jsonl.gz) or Parquet file(s), directory(ies) (searched with `glob`), a dataset
    saved with datasets' save_to_disk, a Hub dataset (hf:NAME[:CONFIG]:SPLIT[@REVISION], streamed; pip install
    'posgpt[hf]'), or a named corpus (shakespeare, python-docs, python-library, auto)."""
    out_dir: str
    """Output directory, created if needed."""
    tokenizer: Literal["char", "gpt2"] = "char"
    """char (vocabulary from the corpus; a newline ends each JSON line's or row's document) or gpt2 (BPE;
    <|endoftext|> ends each document: a text file, a JSON line, a row)."""
    glob: str = "*.txt"
    """File pattern for directories."""
    val_fraction: float = 0.1
    """Share of tokens, taken from the end, for validation (at most `val_max_tokens`)."""
    errors: Literal["strict", "replace"] = "strict"
    """strict rejects invalid UTF-8; replace substitutes U+FFFD for bad bytes."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline BPE (or set POSGPT_TIKTOKEN_RANKS)."""
    workers: int | None = None
    """Threads for BPE encoding (default: all cores)."""
    text_column: str = "text"
    """The column (JSON field) that holds each document's text in JSON-lines, Parquet and datasets sources."""
    val_max_tokens: int | None = VAL_MAX_TOKENS
    """Most tokens of the validation split, the last min(val_fraction of the tokens, this); null: no cap."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"val_fraction must be in [0, 1), got {self.val_fraction}.")
        if self.tokenizer not in ("char", "gpt2"):
            raise DataError(f"Unknown tokenizer {self.tokenizer!r}; valid choices: ['char', 'gpt2'].")
        if self.errors not in ("strict", "replace"):
            raise DataError(f"errors must be 'strict' or 'replace', got {self.errors!r}.")
        cap = self.val_max_tokens
        if cap is not None and (isinstance(cap, bool) or cap < 1):
            raise DataError(f"val_max_tokens must be at least 1 (or null: no cap), got {cap!r}.")


def prepare(inputs: Inputs, out_dir: str, tokenizer: str = "char", **options: Any) -> dict[str, Any]:
    """Tokenize `inputs` (or resolved `Source`s) into `out_dir` with `PrepareConfig`'s other fields; its metadata."""
    cfg = PrepareConfig(inputs, out_dir, tokenizer, **options)  # type: ignore[arg-type]
    return prepare_sources(cfg, resolve_sources(inputs, cfg.glob, cfg.text_column))


def prepare_sources(cfg: PrepareConfig, sources: list[Source]) -> dict[str, Any]:
    """`prepare` of sources already resolved from `cfg.inputs`."""
    out = Path(cfg.out_dir)
    settings = {"tokenizer": cfg.tokenizer, "val_fraction": cfg.val_fraction, "errors": cfg.errors}
    try:
        with waiting_lock(out, tidy=True):  # made where missing; a failed prepare into a new one leaves nothing
            if (existing := _reusable(out, sources, settings, cfg.val_max_tokens)) is not None:
                log.info("Reusing %s: sources and settings unchanged", out)
                return existing
            (out / "meta.json").unlink(missing_ok=True)  # from here on the directory is not trusted
            try:
                return _write(sources, cfg, settings)
            except BaseException:  # without meta.json the token files are never read: give their space back
                for split in ("train", "val"):
                    (out / f"{split}.bin").unlink(missing_ok=True)
                raise
    except OSError as error:  # one message that names the file and the fix
        name = Path(error.filename) if error.filename else out
        reason = error.strerror or str(error)
        if out.resolve() not in (name.resolve(), *name.resolve().parents):
            raise DataError(f"Cannot read {name}: {reason}. Check the path and its permissions.") from None
        fix = "Pass a directory you can write (--data.prepared_root DIR)"
        if error.errno == errno.ENOSPC:
            fix = "Free some space and run it again (what was written is discarded)"
        raise DataError(f"Cannot write prepared data to {out} ({name}: {reason}). {fix}.") from None


def _write(sources: list[Source], cfg: PrepareConfig, settings: dict[str, Any]) -> dict[str, Any]:
    """Tokenize, split and write `meta.json` last, once the output's lock is held."""
    out, cap, val_fraction, errors = Path(cfg.out_dir), cfg.val_max_tokens, cfg.val_fraction, cfg.errors
    gpt2 = cfg.tokenizer == "gpt2"
    tok: Tokenizer = GPT2Tokenizer(cfg.tiktoken_ranks) if gpt2 else CharTokenizer(_char_set(sources, errors))
    dtype = token_dtype(tok.vocab_size)
    total, n_chars = 0, 0  # tokens, and characters of text read (separators and <|endoftext|> not counted)
    with atomic_file(out / "train.bin") as f:  # every token; the last ones are copied to val.bin, then cut off
        with ReadProgress("tokenizing", _total_size(sources)) as progress:
            for ids, read, chars in _encoded(sources, tok, errors, cfg.workers or os.cpu_count() or 1):
                array = np.asarray(ids, dtype=dtype)
                f.write(array.tobytes())
                total, n_chars = total + array.size, n_chars + chars
                progress.update(read, total)
        if n_chars == 0:
            raise DataError(f"The input has no text: {', '.join(source.location for source in sources)} (empty).")
        n_train, n_val, capped = split_sizes(total, val_fraction, cap)
        if n_train < 1 or (val_fraction > 0 and n_val < 1):
            raise DataError(f"The corpus has only {total} tokens, too few to split with val_fraction={val_fraction}.")
        f.flush()
        with open(f.name, "rb") as tokens, atomic_file(out / "val.bin") as val:
            tokens.seek(n_train * dtype.itemsize)
            shutil.copyfileobj(tokens, val)
        f.truncate(n_train * dtype.itemsize)
    if capped:
        log.info(
            "Validation split capped at %s tokens (--data.val_max_tokens), %.2f%% of the %s tokens instead of "
            "val_fraction %g",
            f"{n_val:,}", 100 * n_val / total, f"{total:,}", val_fraction,
        )  # fmt: skip
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.meta(),
        "dtype": dtype.name,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "val_fraction": val_fraction,
        "val_max_tokens": cap,
        "val_capped": capped,
        "errors": errors,
        "name": corpus_name(sources),
        "sources": [source.location for source in sources],
        "source_details": [source.record() for source in sources],
        "fingerprint": fingerprint(sources, settings, cap if capped else None),
        "read": progress.record(),
    }
    atomic_write_bytes(out / "meta.json", json.dumps(meta, indent=1, ensure_ascii=False).encode())
    log.info(
        "Wrote %s: %d train and %d val tokens (%s), %.1f MB read in %.1f s (%.1f MB/s)",
        out, n_train, n_val, dtype.name, progress.read / 1e6, progress.seconds(), progress.mb_per_s(),
    )  # fmt: skip
    return meta


def split_sizes(total: int, val_fraction: float, cap: int | None) -> tuple[int, int, bool]:
    """(train tokens, val tokens, whether the cap bound): the last `val_fraction`, or `cap` where fewer."""
    n_train = int(total * (1.0 - val_fraction))
    if cap is not None and total - n_train > cap:
        return total - cap, cap, True
    return n_train, total - n_train, False


def fingerprint(sources: list[Source], settings: dict[str, Any], cap: int | None = None) -> str:
    """What identifies a prepared dataset: the sources' locations and contents and the settings (`tokenizer`,
    `val_fraction`, `errors`), and `cap` (val_max_tokens) only where it bound the split, so older data keep theirs."""
    capped = {} if cap is None else {"val_max_tokens": cap}
    digest = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **settings, **capped}, sort_keys=True).encode())
    for source in sources:
        digest.update(source.digest)
    return digest.hexdigest()


def _reusable(out: Path, sources: list[Source], settings: dict[str, Any], cap: int | None) -> dict[str, Any] | None:
    """The metadata of `out` when it holds complete output for these sources, settings and cap."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not meta.get("val_capped") and cap is not None and meta.get("val_tokens", 0) > cap:
        return None  # prepared without a cap (or a larger one) that would bind now
    if meta.get("fingerprint") != fingerprint(sources, settings, cap if meta.get("val_capped") else None):
        return None  # other sources or settings, or capped at another val_max_tokens (the fingerprint holds it)
    itemsize = np.dtype(meta["dtype"]).itemsize
    sizes = {out / f"{split}.bin": meta[f"{split}_tokens"] * itemsize for split in ("train", "val")}
    return meta if all(file.is_file() and file.stat().st_size == size for file, size in sizes.items()) else None


class ReadProgress(AbstractContextManager):
    """How far a pass over the sources is: a tqdm bar on a terminal, else an INFO line every tenth (or minute)."""

    def __init__(self, what: str, total: int | None, interactive: bool | None = None) -> None:
        self.what, self.total = what, total or None
        self.read, self.tokens = 0, 0
        self.start = self._last_log = time.perf_counter()
        self.end: float | None = None
        self._tenth = 0
        disable = None if interactive is None else not interactive  # None: tqdm's own, off where stderr is no tty
        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc=what, leave=False, disable=disable)

    def update(self, read: int, tokens: int) -> None:
        """The input is read up to byte `read` and `tokens` are written."""
        self.bar.update(read - self.read)
        self.bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
        self.read, self.tokens = read, tokens
        now = time.perf_counter()
        if not self.bar.disable or now - self.start < QUIET_SECONDS:
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

    def record(self) -> dict[str, float]:
        return {"bytes": self.read, "seconds": round(self.seconds(), 2), "MB/s": round(self.mb_per_s(), 1)}

    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def mb_per_s(self) -> float:
        return self.read / 1e6 / max(self.seconds(), 1e-9)

    def __exit__(self, *exc: object) -> None:
        self.end = time.perf_counter()
        self.bar.close()


def _total_size(sources: list[Source]) -> int | None:
    """Bytes of all the sources, or None where one's size is unknown (a Hub dataset)."""
    sizes = [source.size() for source in sources]
    return None if None in sizes else sum(sizes)


def _batches(
    sources: list[Source], errors: str, bpe: bool, workers: int
) -> Iterator[tuple[list[str], list[bool], int, int]]:
    """(texts, ends, bytes read so far, characters) of about CHUNK_CHARS characters per worker at a time. `ends`
    marks the texts a document ends after: every document in BPE, at char level only those of documents."""
    texts: list[str] = []
    ends: list[bool] = []
    size, base, read = 0, 0, 0
    for source in sources:
        for piece in source.pieces(errors):
            texts.append(piece.text)
            ends.append(piece.end and (bpe or source.format != "text"))
            size += len(piece.text)
            read = base + piece.read
            if size >= workers * CHUNK_CHARS or len(texts) >= MAX_BATCH_PIECES:
                yield texts, ends, read, size
                texts, ends, size = [], [], 0
        base = read
    if texts:
        yield texts, ends, read, size


def _char_set(sources: list[Source], errors: str) -> set[str]:
    """The characters of the whole stream (the char tokenizer's vocabulary), read in a first pass; none is an error."""
    chars: set[str] = set()
    with ReadProgress("reading characters", _total_size(sources)) as progress:
        for texts, ends, read, _ in _batches(sources, errors, False, 1):
            chars.update(*texts)
            if any(ends):
                chars.add("\n")
            progress.update(read, 0)
    if not chars:
        raise DataError(f"The input has no text: {', '.join(source.location for source in sources)} (empty).")
    return chars


def _encoded(sources: list[Source], tok: Tokenizer, errors: str, workers: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """(ids, bytes read so far, characters) of each batch of the sources, encoded while the next one is read
    (reading JSON holds the GIL, BPE encoding mostly does not)."""
    bpe = isinstance(tok, GPT2Tokenizer)
    pending: deque[tuple[Future, int, int]] = deque()
    with ThreadPoolExecutor(1) as driver:
        for texts, ends, read, size in _batches(sources, errors, bpe, workers if bpe else 1):
            pending.append((driver.submit(tok.encode_pieces, texts, ends, workers), read, size))
            if len(pending) > 1:
                future, done, chars = pending.popleft()
                yield future.result(), done, chars
        for future, done, chars in pending:
            yield future.result(), done, chars


def main(cfg: PrepareConfig) -> None:
    meta = prepare_sources(cfg, resolve_sources(cfg.inputs, cfg.glob, cfg.text_column))
    print(json.dumps({k: meta[k] for k in ("train_tokens", "val_tokens", "val_capped", "dtype")}))


COMMAND = Command(
    "posgpt prepare",
    PrepareConfig,
    main,
    "Tokenize text into train.bin / val.bin / meta.json.",
    # the data options of train.py, as messages of shared code name them
    aliases={"data.input": "inputs", "data.prepared_root": "out_dir", "data.": ""},
)

if __name__ == "__main__":  # `python -m` would load this module under a second name, __main__
    raise SystemExit("error: run `posgpt prepare` (or `python -m posgpt prepare`).")
