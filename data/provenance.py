"""What a checkpoint records of its training data, and finding that data again.

Training writes `provenance(data)` into every checkpoint: the prepared directory, its fingerprint
(which covers the sources' contents and the settings), the sources (with their format, text column, a Hub
dataset's name, config, split, revision and commit, a named corpus' manifest) and the validation cap where it
bound (the fingerprint then covers it, so finding the data again needs it). Evaluation reads it back
through `recorded_data` to score a checkpoint on its own validation split, and only while that
split is still the one it was trained beside; `checkpoint_tokenizer` rebuilds the recorded
tokenizer. Everything here takes plain values (the recorded dicts, the checkpoint's path for
messages), so it knows nothing of how checkpoints are loaded or evaluated.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from core.checkpoint import CheckpointError
from data.dataset import PreparedData, load_prepared, prepare_dir
from data.errors import DataError
from data.prepare import VAL_MAX_TOKENS, fingerprint, resolve_sources
from data.sources import Source, modified_after
from data.tokenizer import RANKS_ENV, Tokenizer, tokenizer_from_meta

log = logging.getLogger(__name__)


def provenance(data: PreparedData) -> dict[str, Any]:
    """What a checkpoint records of its training data: enough to find it again and to tell whether
    it is still the same (the fingerprint covers the sources' contents and the settings)."""
    meta = data.meta
    record = {
        "prepared": str(data.path.resolve()),
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


def tiktoken_ranks(explicit: str | None, recorded: str | None) -> str | None:
    """The GPT-2 ranks file to use: the one passed now, else $POSGPT_TIKTOKEN_RANKS, else the one the
    checkpoint recorded (which may have moved since)."""
    return explicit or os.environ.get(RANKS_ENV) or recorded


def checkpoint_tokenizer(
    meta: dict[str, Any], recorded_ranks: str | None, ranks_path: str | None, checkpoint: str | Path
) -> Tokenizer:
    """The tokenizer a checkpoint recorded (`meta`), with the ranks file `tiktoken_ranks` picks; a
    tokenizer that cannot be rebuilt is a `CheckpointError` on `checkpoint` that says how to fix it."""
    try:
        return tokenizer_from_meta(meta, tiktoken_ranks(ranks_path, recorded_ranks))
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
    """The prepared data a checkpoint was trained on, as it records it, and only if it is still that
    data: the recorded prepared directory when its fingerprint is the recorded one, else a fresh
    prepare of the recorded sources when they still hold what they held (same fingerprint). A
    changed text is refused: its split would be tokenized or cut differently from training.

    Args:
        checkpoint: the checkpoint's path, for messages.
        record: the checkpoint's `provenance` record; None in checkpoints written before it was recorded.
        data_config: the checkpoint's resolved data settings (`config["data"]`).
        tokenizer_meta: the description of the checkpoint's tokenizer.
        ranks: the GPT-2 ranks file to prepare with, if any.
    """
    settings = {key: data_config[key] for key in ("tokenizer", "val_fraction", "errors")}
    glob = data_config["glob"]
    column = data_config.get("text_column", "text")  # absent from checkpoints written before it existed
    cap = data_config.get("val_max_tokens", VAL_MAX_TOKENS)
    if record is not None and "task" in record:
        raise DataError(
            f"{checkpoint} was trained on the synthetic task {record['task']['name']!r}, which has no text split: "
            "test it with python -m experiments.synthetic, or pass a text with --eval_data.input FILE."
        )
    if record is None:
        # written before checkpoints recorded their data, so before the cap: the whole last val_fraction
        uncapped = {**settings, "text_column": column, "val_max_tokens": data_config.get("val_max_tokens")}
        return _unrecorded_data(checkpoint, data_config, uncapped, tokenizer_meta, ranks)
    try:
        prepared: PreparedData | None = load_prepared(record["prepared"])
    except DataError:
        prepared = None  # gone or incomplete
    if prepared is not None and prepared.meta.get("fingerprint") == record["fingerprint"]:
        edited = _edited_since(record["sources"], prepared.path / "meta.json")
        if edited and _unchanged_sources(record, glob, column, settings) is not None:
            edited = []  # touched (copied, checked out) but holding what they held
        if edited:
            log.warning(
                "%s changed since training; %s evaluates on the split prepared from it at training time (%s)",
                ", ".join(edited),
                checkpoint,
                prepared.path,
            )
        return prepared
    # gone, or prepared again from other text: prepare it anew only from sources that still hold
    # what they held (hashing them, which only this path needs)
    sources = _unchanged_sources(record, glob, column, settings)
    if sources is None:
        raise DataError(_changed_data(checkpoint, f"{', '.join(record['sources'])} changed or moved since"))
    root = str(Path(record["prepared"]).parent)
    if record.get("val_capped"):
        cap = record["val_max_tokens"]
    elif cap is not None and record["val_tokens"] > cap:
        cap = None  # a split prepared before the cap existed, larger than it: prepare it uncapped, as it was
    return prepare_dir(
        sources, None, root, **settings, glob=glob, tiktoken_ranks=ranks, text_column=column, val_max_tokens=cap
    )


def _unrecorded_data(
    checkpoint: str,
    data_config: dict[str, Any],
    settings: dict[str, Any],
    tokenizer_meta: dict[str, Any],
    ranks: str | None,
) -> PreparedData:
    """The data of a checkpoint written before checkpoints recorded their data, prepared from its data
    settings: without a fingerprint to compare, the tokenizers must agree at least."""
    c = data_config
    prepared = prepare_dir(c["input"], c["dir"], c["prepared_root"], **settings, glob=c["glob"], tiktoken_ranks=ranks)
    if prepared.meta["tokenizer"] != tokenizer_meta:
        raise DataError(_changed_data(checkpoint, f"{prepared.path} now has another vocabulary"))
    return prepared


def _unchanged_sources(record: dict[str, Any], glob: str, column: str, settings: dict[str, Any]) -> list[Source] | None:
    """The recorded sources, if they still hold what they held at training (hashing them); else None. They
    are read as recorded (format, column) where the record says, else resolved from their paths again."""
    if record.get("val_capped"):
        settings = {**settings, "val_max_tokens": record["val_max_tokens"]}
    try:
        details = record.get("source_details")
        if details:
            sources = [Source.from_record(detail) for detail in details]
        else:
            sources = resolve_sources(record["sources"], glob, column)
        return sources if fingerprint(sources, settings) == record["fingerprint"] else None
    except (DataError, OSError):
        return None


def _edited_since(sources: list[str], reference: Path) -> list[str]:
    """The sources modified (or gone) since `reference` was written: a stat each, no hashing."""
    stamp = reference.stat().st_mtime
    return [s for s in sources if modified_after(s, stamp)]


def _changed_data(checkpoint: str, what: str) -> str:
    return (
        f"{checkpoint} was trained on other data than there is now: {what}, so its validation split cannot be "
        "rebuilt. Evaluate on a text of your choice with --eval_data.input FILE (tokenized with the checkpoint's "
        "own tokenizer), or restore the original text."
    )
