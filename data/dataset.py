"""Prepared directories: opening one, preparing (or reusing) one from a run's data settings, what a checkpoint
records of it (`PreparedData.record`) and finding that data again (`recorded_data`) while it is still the data it
was trained beside. And windows over its tokens: random for training (batch i of rank r drawn from the seed (seed,
r, i), so a resumed run draws exactly what an uninterrupted one would), fixed and non-overlapping from the start
of a split for evaluation (so a val loss is comparable across runs)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from posgpt.core.checkpoint import CheckpointError
from posgpt.data.errors import DataError
from posgpt.data.prepare import (
    FORMAT_VERSION,
    VAL_MAX_TOKENS,
    PrepareConfig,
    fingerprint,
    prepare_sources,
    resolve_sources,
)
from posgpt.data.sources import Source, corpus_name, modified_after
from posgpt.data.tokenizer import RANKS_ENV, Tokenizer, tokenizer_from_meta

log = logging.getLogger(__name__)

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

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of its training data: enough to find it again and tell whether it changed."""
        meta = self.meta
        record = {
            "prepared": str(self.path.resolve()),
            "fingerprint": meta.get("fingerprint"),
            "sources": meta.get("sources", []),
            "tokenizer": meta["tokenizer"]["kind"],
            "train_tokens": meta["train_tokens"],
            "val_tokens": meta["val_tokens"],
        }
        if meta.get("source_details"):
            record["source_details"] = meta["source_details"]
        if meta.get("val_capped"):
            record.update(val_capped=True, val_max_tokens=meta["val_max_tokens"])
        return record


def load_prepared(path: str | Path) -> PreparedData:
    """Open a prepared directory, refusing one that is incomplete or from another format version."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(
            f"{path} is not a prepared dataset directory ({'a file' if path.exists() else 'not found'}). "
            "Pass a directory written by `posgpt prepare`, or the text itself with --data.input FILE."
        )
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise DataError(
            f"{path} is not a prepared dataset (no meta.json; an interrupted prepare leaves none). "
            "Run `posgpt prepare` on your text, or pass --data.input FILE instead."
        ) from None
    except (OSError, ValueError) as error:
        raise DataError(f"{path}/meta.json is unreadable or corrupt ({error}); re-run `posgpt prepare`.") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise DataError(f"{path} was prepared by another version (format {version}); re-run prepare.")
    try:
        data = PreparedData(path, meta)
        sizes = {split: meta[f"{split}_tokens"] * data.dtype.itemsize for split in ("train", "val")}
        _ = meta["tokenizer"]["kind"]
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(f"{path}/meta.json lacks or garbles {error}; re-run `posgpt prepare`.") from None
    for split, expected in sizes.items():
        file = path / f"{split}.bin"
        if not file.is_file() or file.stat().st_size != expected:
            raise DataError(f"{file} is missing or incomplete; re-run `posgpt prepare`.")
    return data


def prepare_dir(inputs: str | list[str] | list[Source], prepared: str | None, prepared_root: str, **options: Any
                ) -> PreparedData:  # fmt: skip
    """The prepared directory `prepared`, or one prepared (or reused) from `inputs` under `prepared_root` with
    `PrepareConfig`'s other fields, named after the text and keyed by the sources and settings (those added
    later only where not default)."""
    if prepared:
        return load_prepared(prepared)
    cfg = PrepareConfig(inputs, "", **options)  # type: ignore[arg-type]
    sources = resolve_sources(inputs, cfg.glob, cfg.text_column)
    settings = [source.location for source in sources] + [cfg.tokenizer, str(cfg.val_fraction), cfg.errors, cfg.glob]
    later = {"text_column": "text", "val_max_tokens": VAL_MAX_TOKENS}  # their defaults keep the older keys
    settings += [f"{name}={getattr(cfg, name)}" for name, default in later.items() if getattr(cfg, name) != default]
    key = hashlib.sha256("\n".join(settings).encode()).hexdigest()[:10]
    out = Path(prepared_root) / f"{corpus_name(sources)}-{cfg.tokenizer}-{key}"
    return PreparedData(out, prepare_sources(dataclasses.replace(cfg, out_dir=str(out)), sources))


def _window_batch(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> Batch:
    rows = torch.from_numpy(np.stack([tokens[o : o + block_size + 1] for o in offsets]).astype(np.int64))  # (B, T+1)
    return rows[:, :-1], rows[:, 1:]


class SeededStream(IterableDataset):
    """An endless stream of batches `batch(i)` from i = `start()` (read when iteration starts, after a checkpoint
    was restored), where batch i of a rank is a function of (seed, rank, i) alone."""

    def __init__(self, batch: Callable[[int], Batch], start: Callable[[], int] = lambda: 0) -> None:
        self.batch, self.start = batch, start

    def __iter__(self) -> Iterator[Batch]:
        yield from map(self.batch, itertools.count(self.start()))


def random_windows(
    data: PreparedData, block_size: int, batch_size: int, seed: int, rank: int
) -> Callable[[int], Batch]:
    """Batch i of rank `rank`: random windows of `block_size` + 1 tokens of the training split."""
    tokens = data.tokens("train")

    def batch(index: int) -> Batch:
        rng = np.random.default_rng([seed, rank, index])
        return _window_batch(tokens, rng.integers(0, len(tokens) - block_size, size=batch_size), block_size)

    return batch


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


def checkpoint_tokenizer(
    meta: dict[str, Any], recorded_ranks: str | None, ranks_path: str | None, checkpoint: str | Path
) -> Tokenizer:
    """The tokenizer a checkpoint recorded (`meta`), GPT-2's from the ranks file passed now, else
    $POSGPT_TIKTOKEN_RANKS, else the one recorded; one that cannot be rebuilt is a `CheckpointError`."""
    try:
        return tokenizer_from_meta(meta, ranks_path or os.environ.get(RANKS_ENV) or recorded_ranks)
    except DataError as error:
        raise CheckpointError(
            f"Cannot rebuild the tokenizer of {checkpoint}: {error} Pass the ranks file with --tiktoken_ranks PATH "
            f"or set {RANKS_ENV}."
        ) from None


def recorded_data(
    checkpoint: str,
    record: dict[str, Any] | None,
    data_config: dict[str, Any],
    tokenizer_meta: dict[str, Any],
    ranks: str | None = None,
) -> PreparedData:
    """The prepared data a checkpoint was trained on, only if it is still that data: the recorded directory
    when its fingerprint is the recorded one, else a fresh prepare of the recorded sources when they still
    hold what they held. `record` is the checkpoint's `PreparedData.record` (None in checkpoints older than it),
    `data_config` its `config["data"]`; `checkpoint` names it in messages."""
    settings = {key: data_config[key] for key in ("tokenizer", "val_fraction", "errors")}
    glob = data_config["glob"]
    column = data_config.get("text_column", "text")  # absent from checkpoints written before it existed
    cap = data_config.get("val_max_tokens", VAL_MAX_TOKENS)
    options = {**settings, "glob": glob, "tiktoken_ranks": ranks, "text_column": column}  # of `prepare_dir`
    if record is not None and "task" in record:
        raise DataError(
            f"{checkpoint} was trained on the synthetic task {record['task']['name']!r}, which has no text split: "
            "test it with posgpt study synthetic, or pass a text with --eval_data.input FILE."
        )
    if record is None:
        # written before checkpoints recorded their data (so before the cap: the whole last val_fraction), and
        # without a fingerprint to compare: the tokenizers must agree at least
        c = data_config
        prepared = prepare_dir(
            c["input"], c["dir"], c["prepared_root"], **options, val_max_tokens=c.get("val_max_tokens")
        )
        if prepared.meta["tokenizer"] != tokenizer_meta:
            raise DataError(_changed_data(checkpoint, f"{prepared.path} now has another vocabulary"))
        return prepared
    try:
        prepared: PreparedData | None = load_prepared(record["prepared"])
    except DataError:
        prepared = None  # gone or incomplete
    if prepared is not None and prepared.meta.get("fingerprint") == record["fingerprint"]:
        stamp = (prepared.path / "meta.json").stat().st_mtime
        edited = [source for source in record["sources"] if modified_after(source, stamp)]
        if edited and _unchanged_sources(record, glob, column, settings) is None:  # not merely touched
            log.warning(
                "%s changed since training; %s evaluates on the split prepared from it at training time (%s)",
                ", ".join(edited), checkpoint, prepared.path,
            )  # fmt: skip
        return prepared
    # gone, or prepared again from other text: prepare it anew from sources still holding what they held
    if (sources := _unchanged_sources(record, glob, column, settings)) is None:
        raise DataError(_changed_data(checkpoint, f"{', '.join(record['sources'])} changed or moved since"))
    if record.get("val_capped"):
        cap = record["val_max_tokens"]
    elif cap is not None and record["val_tokens"] > cap:
        cap = None  # a split prepared before the cap existed, larger than it: prepare it uncapped, as it was
    return prepare_dir(sources, None, str(Path(record["prepared"]).parent), **options, val_max_tokens=cap)


def _unchanged_sources(record: dict[str, Any], glob: str, column: str, settings: dict[str, Any]) -> list[Source] | None:
    """The recorded sources if they still hold what they held at training (hashing them); else None."""
    try:
        if details := record.get("source_details"):
            sources = [Source.from_record(detail) for detail in details]
        else:
            sources = resolve_sources(record["sources"], glob, column)
        cap = record["val_max_tokens"] if record.get("val_capped") else None
        return sources if fingerprint(sources, settings, cap) == record["fingerprint"] else None
    except (DataError, OSError):
        return None


def _changed_data(checkpoint: str, what: str) -> str:
    return (
        f"{checkpoint} was trained on other data than there is now: {what}, so its validation split cannot be "
        "rebuilt. Evaluate on a text of your choice with --eval_data.input FILE (tokenized with the checkpoint's "
        "own tokenizer), or restore the original text."
    )
