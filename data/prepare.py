"""Turn text into memory-mapped token files: `train.bin`, `val.bin` and `meta.json`.

    python -m data.prepare --inputs corpus/ --out_dir prepared/mycorpus --tokenizer gpt2

Input is a file, several files, a directory (recursive, `*.txt` by default) or a named corpus
(`shakespeare`, `python-docs`, `auto`: see `data.corpora`). Text is streamed in chunks that end on
line boundaries, so memory stays bounded whatever the corpus size; GPT-2 BPE encodes a batch of
chunks at once on several threads. The last
`val_fraction` of the tokens is the validation split (as nanoGPT does): deterministic, and
contiguous, so no window straddles the two splits.

Writes are atomic: `meta.json` is removed first and written last, after both token files are in
place, and the data loader trusts a directory only when `meta.json` is there and agrees with the
files. Re-running on unchanged sources and settings reuses the output. A directory lock serialises
concurrent prepares of one output (the second waits, then reuses what the first wrote), and
temporary files carry the writer's pid; those a killed prepare left are removed by the next one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from core.cli import Command, run
from core.files import LockedError, atomic_write_bytes, directory_lock, remove_stale_tmp, sha256_file, tmp_path
from data.corpora import NAMED
from data.errors import DataError
from data.tokenizer import GPT2Tokenizer, Tokenizer, build_tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHUNK_CHARS = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (GPT-2's 50257 does), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def resolve_sources(inputs: str | os.PathLike | Sequence[str | os.PathLike], glob: str = "*.txt") -> list[Path]:
    """The files to read, in a fixed order: files as given, directories searched recursively."""
    items = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    if not items:
        raise DataError(f"No input given: pass --data.input FILE|DIR or a named corpus ({', '.join(NAMED)}).")
    sources: list[Path] = []
    for item in items:
        if str(item) in NAMED:
            sources.append(NAMED[str(item)]())
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob(glob) if p.is_file())
            if not found:
                raise DataError(f"Directory {path} has no files matching {glob!r}; pass --data.glob PATTERN.")
            sources.extend(found)
        elif path.is_file():
            sources.append(path)
        else:
            raise DataError(
                f"Input not found: {path}. Pass an existing file or directory, or a named corpus ({', '.join(NAMED)})."
            )
    return list(dict.fromkeys(p.resolve() for p in sources))  # drop repeats, keep order


@dataclass
class PrepareConfig:
    """What to tokenize, into which directory, how (`python -m data.prepare`)."""

    inputs: str | list[str]
    """File(s), directory(ies) or a named corpus (`data.corpora.NAMED`: shakespeare, python-docs, auto)."""
    out_dir: str
    """Output directory, created if needed."""
    tokenizer: Literal["char", "gpt2"] = "char"
    """char (vocabulary from the corpus) or gpt2 (BPE; <|endoftext|> after each file)."""
    glob: str = "*.txt"
    """File pattern for directories."""
    val_fraction: float = 0.1
    """Share of tokens, taken from the end, for validation."""
    errors: Literal["strict", "replace"] = "strict"
    """strict rejects invalid UTF-8; replace substitutes U+FFFD for bad bytes."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline BPE (or set POSGPT_TIKTOKEN_RANKS)."""
    workers: int | None = None
    """Threads for BPE encoding (default: all cores)."""


def prepare(
    inputs: str | list[str],
    out_dir: str,
    tokenizer: Literal["char", "gpt2"] = "char",
    glob: str = "*.txt",
    val_fraction: float = 0.1,
    errors: Literal["strict", "replace"] = "strict",
    tiktoken_ranks: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """Tokenize `inputs` into `out_dir` (see the module docstring) and return its metadata; the
    arguments are the fields of `PrepareConfig`."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}.")
    if tokenizer not in ("char", "gpt2"):
        raise DataError(f"Unknown tokenizer {tokenizer!r}; valid choices: ['char', 'gpt2'].")
    if errors not in ("strict", "replace"):
        raise DataError(f"errors must be 'strict' or 'replace', got {errors!r}.")
    sources = resolve_sources(inputs, glob)
    out = Path(out_dir)
    settings = {"tokenizer": tokenizer, "val_fraction": val_fraction, "errors": errors}
    key = fingerprint(sources, settings)
    try:
        with _prepare_lock(out):
            return _prepare_locked(sources, out, tokenizer, settings, key, tiktoken_ranks, workers)
    except OSError as error:
        raise _os_error(error, out) from None


def _os_error(error: OSError, out: Path) -> DataError:
    """A file-system error of a prepare as one message that names the file and the fix."""
    name = Path(error.filename) if error.filename else out
    reason = error.strerror or str(error)
    if out.resolve() in (name.resolve(), *name.resolve().parents):
        fix = (
            "Free some space and run it again (what was written is discarded)"
            if error.errno == errno.ENOSPC
            else "Pass a directory you can write (--data.prepared_root DIR)"
        )
        return DataError(f"Cannot write prepared data to {out} ({name}: {reason}). {fix}.")
    return DataError(f"Cannot read {name}: {reason}. Check the path and its permissions.")


@contextlib.contextmanager
def _prepare_lock(out: Path) -> Iterator[None]:
    """The output's lock: at once when free, else (another prepare of the same output is running)
    after saying that this one waits for it."""
    try:
        with directory_lock(out):
            yield
        return
    except LockedError as error:
        log.info("%s; waiting for it to finish", error)
    with directory_lock(out, wait=True):
        yield


def _prepare_locked(
    sources: list[Path],
    out: Path,
    tokenizer: str,
    settings: dict[str, Any],
    key: str,
    tiktoken_ranks: str | None,
    workers: int | None,
) -> dict[str, Any]:
    """`prepare`, once the output's lock is held; `key` is the fingerprint of sources and settings."""
    val_fraction, errors = settings["val_fraction"], settings["errors"]
    existing = _reusable(out, key)
    if existing is not None:
        log.info("Reusing %s: sources and settings unchanged", out)
        return existing
    remove_stale_tmp(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # from here on, the directory is not trusted
    chars: set[str] = set()
    if tokenizer == "char":
        for chunk in _read_all(sources, errors):
            chars.update(chunk)
        if not chars:
            raise DataError(f"The input has no text: {_names(sources)} (empty).")
    tok = build_tokenizer(tokenizer, chars, tiktoken_ranks)
    dtype = token_dtype(tok.vocab_size)
    tmp = tmp_path(out / "tokens.bin")
    try:
        total = _write_tokens(tmp, sources, tok, dtype, errors, workers or os.cpu_count() or 1)
        if total == 0:
            raise DataError(f"The input has no text: {_names(sources)} (empty).")
        n_train = int(total * (1.0 - val_fraction))  # nanoGPT's split: data[: int(n * 0.9)]
        n_val = total - n_train
        if n_train < 1 or (val_fraction > 0 and n_val < 1):
            raise DataError(f"The corpus has only {total} tokens, too few to split with val_fraction={val_fraction}.")
        _split(tmp, out, n_train, dtype)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.meta(),
        "dtype": dtype.name,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "val_fraction": val_fraction,
        "errors": errors,
        "sources": [str(p) for p in sources],
        "fingerprint": key,
    }
    atomic_write_bytes(out / "meta.json", json.dumps(meta, indent=1, ensure_ascii=False).encode())
    log.info("Wrote %s: %d train and %d val tokens (%s)", out, n_train, n_val, dtype.name)
    return meta


def _names(sources: list[Path]) -> str:
    return ", ".join(map(str, sources))


def _read_chunks(path: Path, errors: str) -> Iterator[str]:
    """Text of `path` in pieces of about CHUNK_CHARS characters that end on line boundaries."""
    try:
        with open(path, encoding="utf-8", errors=errors, newline="") as f:
            while chunk := f.read(CHUNK_CHARS):
                if not chunk.endswith("\n"):
                    chunk += f.readline()
                if "\x00" in chunk:
                    raise DataError(f"{path} looks like a binary file (it contains NUL bytes); pass text files.")
                yield chunk
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path} is not valid UTF-8 ({error.reason}, byte value {error.object[error.start]:#04x}). "
            "Convert it to UTF-8, or pass --data.errors replace to replace invalid bytes."
        ) from None


def _read_all(sources: list[Path], errors: str) -> Iterator[str]:
    for path in sources:
        yield from _read_chunks(path, errors)


def _write_tokens(path: Path, sources: list[Path], tok: Tokenizer, dtype: np.dtype, errors: str, workers: int) -> int:
    """Encode every source into one flat token file; return the number of tokens."""
    total = 0
    with open(path, "wb") as f:
        for ids in _encoded(sources, tok, errors, workers):
            array = np.asarray(ids, dtype=dtype)
            f.write(array.tobytes())
            total += array.size
    return total


def _encoded(sources: list[Path], tok: Tokenizer, errors: str, workers: int) -> Iterator[list[int]]:
    if not isinstance(tok, GPT2Tokenizer):
        for chunk in _read_all(sources, errors):
            yield tok.encode(chunk)
        return
    for path in sources:  # BPE: a batch of chunks per call, encoded in parallel; EOT ends each file
        batch: list[str] = []
        for chunk in _read_chunks(path, errors):
            batch.append(chunk)
            if len(batch) == workers:
                yield from tok.encode_batch(batch, num_threads=workers)
                batch = []
        if batch:
            yield from tok.encode_batch(batch, num_threads=workers)
        yield [tok.eot_id]


def _split(tokens: Path, out: Path, n_train: int, dtype: np.dtype) -> None:
    """Last tokens -> val.bin; the file itself, truncated to the first n_train, -> train.bin."""
    all_tokens = np.memmap(tokens, dtype=dtype, mode="r")
    val_tmp = tmp_path(out / "val.bin")
    with open(val_tmp, "wb") as f:
        for start in range(n_train, all_tokens.size, 1 << 24):
            f.write(np.asarray(all_tokens[start : start + (1 << 24)]).tobytes())
        f.flush()
        os.fsync(f.fileno())
    del all_tokens
    with open(tokens, "r+b") as f:
        f.truncate(n_train * dtype.itemsize)
        f.flush()
        os.fsync(f.fileno())
    os.replace(val_tmp, out / "val.bin")
    os.replace(tokens, out / "train.bin")


def fingerprint(sources: list[Path], settings: dict[str, Any]) -> str:
    """What identifies a prepared dataset: the sources' paths and contents and the settings
    (`tokenizer`, `val_fraction`, `errors`); checkpoints record it."""
    digest = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    for path in sources:
        digest.update(str(path).encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


def _reusable(out: Path, key: str) -> dict[str, Any] | None:
    """The existing metadata when `out` holds complete output for this fingerprint."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != key:
        return None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        file = out / f"{split}.bin"
        if not file.is_file() or file.stat().st_size != meta[f"{split}_tokens"] * itemsize:
            return None
    return meta


def main(cfg: PrepareConfig) -> None:
    """Prepare, then print the token counts."""
    meta = prepare(**asdict(cfg))
    print(json.dumps({k: meta[k] for k in ("train_tokens", "val_tokens", "dtype")}))


COMMAND = Command(
    "python -m data.prepare",
    PrepareConfig,
    main,
    "Tokenize text into train.bin / val.bin / meta.json.",
    # the data options of train.py, as messages of shared code name them
    aliases={"data.input": "inputs", "data.prepared_root": "out_dir", "data.": ""},
)

if __name__ == "__main__":
    run(COMMAND)
