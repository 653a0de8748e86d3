"""Prepared token files -> training windows (random; batch i of rank r drawn from the seed (seed, r, i), so
a resumed run draws exactly what an uninterrupted one would) and evaluation windows (fixed, non-overlapping,
from the start of the split, so a val loss is comparable across runs)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from data.errors import DataError
from data.prepare import FORMAT_VERSION, VAL_MAX_TOKENS, prepare, resolve_sources
from data.sources import Source, corpus_name
from data.tokenizer import Tokenizer, tokenizer_from_meta

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PreparedData:
    """A directory written by `data.prepare`: its metadata and the paths of its token files."""

    path: Path
    meta: dict[str, Any]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.memmap:
        """The `split` ("train" or "val") tokens, memory-mapped read-only."""
        return np.memmap(self.path / f"{split}.bin", dtype=self.dtype, mode="r")

    def tokenizer(self, ranks_path: str | None = None) -> Tokenizer:
        return tokenizer_from_meta(self.meta["tokenizer"], ranks_path)


def load_prepared(path: str | Path) -> PreparedData:
    """Open a prepared directory, refusing one that is incomplete or from another format version."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(
            f"{path} is not a prepared dataset directory ({'a file' if path.exists() else 'not found'}). "
            "Pass a directory written by `python -m data.prepare`, or the text itself with --data.input FILE."
        )
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise DataError(
            f"{path} is not a prepared dataset (no meta.json; an interrupted prepare leaves none). "
            "Run `python -m data.prepare` on your text, or pass --data.input FILE instead."
        ) from None
    except (OSError, ValueError) as error:
        raise DataError(
            f"{path}/meta.json is unreadable or corrupt ({error}); re-run `python -m data.prepare`."
        ) from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise DataError(f"{path} was prepared by another version (format {version}); re-run prepare.")
    try:
        data = PreparedData(path, meta)
        sizes = {split: meta[f"{split}_tokens"] * data.dtype.itemsize for split in ("train", "val")}
        _ = meta["tokenizer"]["kind"]
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(f"{path}/meta.json lacks or garbles {error}; re-run `python -m data.prepare`.") from None
    for split, expected in sizes.items():
        file = path / f"{split}.bin"
        if not file.is_file() or file.stat().st_size != expected:
            raise DataError(f"{file} is missing or incomplete; re-run `python -m data.prepare`.")
    return data


def prepare_dir(
    inputs: str | list[str] | list[Source] | None,
    prepared: str | None,
    prepared_root: str,
    tokenizer: str = "char",
    glob: str = "*.txt",
    val_fraction: float = 0.1,
    errors: str = "strict",
    tiktoken_ranks: str | None = None,
    text_column: str = "text",
    val_max_tokens: int | None = VAL_MAX_TOKENS,
) -> PreparedData:
    """The prepared directory `prepared`, or one prepared (or reused) from `inputs` under `prepared_root`,
    named after the text and keyed by the sources and settings (those added later only where not default)."""
    if prepared:
        return load_prepared(prepared)
    if not inputs:
        raise DataError(
            "No data: pass --data.input FILE|DIR|hf:NAME:SPLIT|auto|shakespeare|python-docs|python-library or "
            "--data.dir PREPARED_DIR."
        )
    sources = resolve_sources(inputs, glob, text_column)
    settings = [source.location for source in sources] + [tokenizer, str(val_fraction), errors, glob]
    if text_column != "text":
        settings.append(f"text_column={text_column}")
    if val_max_tokens != VAL_MAX_TOKENS:
        settings.append(f"val_max_tokens={val_max_tokens}")
    key = hashlib.sha256("\n".join(settings).encode()).hexdigest()[:10]
    out = Path(prepared_root) / f"{corpus_name(sources)}-{tokenizer}-{key}"
    prepare(sources, str(out), tokenizer, glob, val_fraction, errors, tiktoken_ranks, None, text_column, val_max_tokens)
    return load_prepared(out)


def _window_batch(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> Batch:
    rows = np.stack([tokens[o : o + block_size + 1] for o in offsets]).astype(np.int64)  # (B, T+1)
    rows_t = torch.from_numpy(rows)
    return rows_t[:, :-1], rows_t[:, 1:]


class SeededStream(IterableDataset):
    """An endless stream of training batches from batch `start()` (read when iteration starts, after a
    checkpoint was restored), where batch i of a rank is a function of (seed, rank, i) alone."""

    def __init__(self, batch_size: int, seed: int, rank: int, start: Callable[[], int]) -> None:
        super().__init__()
        self.batch_size, self.seed, self.rank, self.start = batch_size, seed, rank, start

    def batch(self, index: int) -> Batch:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Batch]:
        index = self.start()
        while True:
            yield self.batch(index)
            index += 1


class RandomWindows(SeededStream):
    """Batches of random windows of `block_size` + 1 tokens of the training split."""

    def __init__(
        self, data: PreparedData, block_size: int, batch_size: int, seed: int, rank: int, start: Callable[[], int]
    ) -> None:
        super().__init__(batch_size, seed, rank, start)
        self.data, self.block_size = data, block_size
        self._tokens: np.memmap | None = None  # mapped at the first batch, in the process that iterates

    def batch(self, index: int) -> Batch:
        if self._tokens is None:
            self._tokens = self.data.tokens("train")
        tokens = self._tokens
        rng = np.random.default_rng([self.seed, self.rank, index])
        offsets = rng.integers(0, len(tokens) - self.block_size, size=self.batch_size)
        return _window_batch(tokens, offsets, self.block_size)


def window_starts(n_tokens: int, length: int, stride: int, token_budget: int) -> np.ndarray:
    """Start offsets of the windows: advancing by `stride`, each needing length + 1 tokens, until
    `token_budget` tokens are scored (stride per window) or the text ends."""
    last_start = n_tokens - (length + 1)
    if last_start < 0:
        return np.zeros(0, dtype=np.int64)
    n_windows = min(last_start // stride + 1, max(1, token_budget // stride))
    return np.arange(n_windows, dtype=np.int64) * stride


class FixedWindows(Dataset):
    """Non-overlapping windows from the start of a split, `batch_size` per item."""

    def __init__(self, data: PreparedData, split: str, block_size: int, batch_size: int, max_tokens: int = 0):
        self.data, self.split, self.block_size, self.batch_size = data, split, block_size, batch_size
        n_tokens = data.meta[f"{split}_tokens"]
        self.offsets = window_starts(n_tokens, block_size, block_size, max_tokens or n_tokens)

    def __len__(self) -> int:
        return -(-len(self.offsets) // self.batch_size)

    def __getitem__(self, i: int) -> Batch:
        offsets = self.offsets[i * self.batch_size : (i + 1) * self.batch_size]
        return _window_batch(self.data.tokens(self.split), offsets, self.block_size)
