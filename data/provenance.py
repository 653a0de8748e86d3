"""What a checkpoint records of its training data (`provenance`), and finding that data again
(`recorded_data`) while it is still the data it was trained beside. Plain values in, so this knows nothing of
how checkpoints are loaded or evaluated.
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
    """What a checkpoint records of its training data: enough to find it again and tell whether it changed."""
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
    """The GPT-2 ranks file: the one passed now, else $POSGPT_TIKTOKEN_RANKS, else the one recorded."""
    return explicit or os.environ.get(RANKS_ENV) or recorded


def checkpoint_tokenizer(
    meta: dict[str, Any], recorded_ranks: str | None, ranks_path: str | None, checkpoint: str | Path
) -> Tokenizer:
    """The tokenizer a checkpoint recorded (`meta`); one that cannot be rebuilt is a `CheckpointError`."""
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
    """The prepared data a checkpoint was trained on, only if it is still that data: the recorded directory
    when its fingerprint is the recorded one, else a fresh prepare of the recorded sources when they still
    hold what they held. `record` is the checkpoint's `provenance` (None in checkpoints older than it),
    `data_config` its `config["data"]`; `checkpoint` names it in messages."""
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
        # written before checkpoints recorded their data (so before the cap: the whole last val_fraction), and
        # without a fingerprint to compare: the tokenizers must agree at least
        c = data_config
        uncapped = {**settings, "text_column": column, "val_max_tokens": c.get("val_max_tokens")}
        prepared = prepare_dir(c["input"], c["dir"], c["prepared_root"], **uncapped, glob=glob, tiktoken_ranks=ranks)
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
                ", ".join(edited),
                checkpoint,
                prepared.path,
            )
        return prepared
    # gone, or prepared again from other text: prepare it anew from sources still holding what they held
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


def _unchanged_sources(record: dict[str, Any], glob: str, column: str, settings: dict[str, Any]) -> list[Source] | None:
    """The recorded sources if they still hold what they held at training (hashing them); else None."""
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


def _changed_data(checkpoint: str, what: str) -> str:
    return (
        f"{checkpoint} was trained on other data than there is now: {what}, so its validation split cannot be "
        "rebuilt. Evaluate on a text of your choice with --eval_data.input FILE (tokenized with the checkpoint's "
        "own tokenizer), or restore the original text."
    )
