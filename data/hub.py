"""Hugging Face Hub datasets as a corpus source, streamed: `--data.input hf:NAME[:CONFIG]:SPLIT[@REVISION]`.
The revision is resolved to its commit once and the source pinned to it: the rows are read at that commit, and
the fingerprint, meta.json and checkpoints take the pinned spec, so finding the data again needs no network.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from data.errors import DataError
from data.readers import COLUMN_HINT, Piece, first_line, optional_import

PREFIX = "hf:"
SYNTAX = "hf:NAME[:CONFIG]:SPLIT[@REVISION]"
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubSpec:
    """A Hub dataset's split: `hf:NAME[:CONFIG]:SPLIT[@REVISION]`."""

    name: str
    config: str | None
    split: str
    revision: str | None = None  # a branch, tag or commit; None: the default branch

    @classmethod
    def parse(cls, text: str) -> HubSpec:
        body = text[len(PREFIX) :] if text.startswith(PREFIX) else text
        body, at, revision = body.partition("@")
        parts = body.split(":")
        if len(parts) not in (2, 3) or not all(parts) or (at and not revision):
            raise DataError(
                f"Cannot read the Hub dataset {text!r}: write {SYNTAX}, e.g. hf:Salesforce/wikitext:"
                "wikitext-103-raw-v1:train (the split is required)."
            )
        return cls(parts[0], parts[1] if len(parts) == 3 else None, parts[-1], revision or None)

    def __str__(self) -> str:
        config = f":{self.config}" if self.config else ""
        revision = f"@{self.revision}" if self.revision else ""
        return f"{PREFIX}{self.name}{config}:{self.split}{revision}"

    @property
    def pinned(self) -> bool:
        """Whether the revision is a full commit hash."""
        return bool(self.revision and _COMMIT.fullmatch(self.revision))


def pin(spec: HubSpec) -> HubSpec:
    """`spec` at the commit its revision names now (asking the Hub, unless it already is a commit)."""
    if spec.pinned:
        return spec
    hub = optional_import("huggingface_hub", f"Reading {spec}", "hf")
    optional_import("datasets", f"Reading {spec}", "hf")  # fail before anything is prepared
    try:
        commit = hub.HfApi().dataset_info(spec.name, revision=spec.revision).sha
    except Exception as error:  # offline, unknown dataset or revision: huggingface_hub raises many types
        raise DataError(
            f"Cannot find {spec} on the Hugging Face Hub ({type(error).__name__}: {first_line(error)}). Check the "
            "name and revision. Offline, data prepared online is reused through the pinned spec its meta.json "
            "records (hf:...@COMMIT) or --data.dir DIR; or pass a dataset saved with save_to_disk."
        ) from None
    return replace(spec, revision=commit) if commit else spec


def hub_pieces(spec: HubSpec, column: str) -> Iterator[Piece]:
    """The split's rows' `column`, streamed in order; `read` counts characters of text."""
    datasets = optional_import("datasets", f"Reading {spec}", "hf")
    try:
        rows = datasets.load_dataset(spec.name, spec.config, split=spec.split, streaming=True, revision=spec.revision)
    except Exception as error:  # unknown config or split, no network: datasets raises many types
        raise DataError(f"Cannot stream {spec} ({type(error).__name__}: {first_line(error)}).") from None
    read, documents = 0, 0
    try:
        for row in rows:
            value = _row_text(spec, row, column)
            if value:
                read += len(value)
                documents += 1
                yield Piece(value, True, read)
    except DataError:
        raise
    except Exception as error:  # the connection dropped, a shard is unreadable: datasets raises many types
        raise DataError(
            f"Streaming {spec} failed after {documents} documents ({type(error).__name__}: {first_line(error)}); "
            "run the command again (nothing half-written is kept)."
        ) from None
    if not documents:
        raise DataError(f"{spec} has no documents (no non-empty {column!r} values); {COLUMN_HINT}.")


def _row_text(spec: HubSpec, row: dict[str, Any], column: str) -> str | None:
    if column not in row:
        raise DataError(f"{spec} has no column {column!r} (its columns: {', '.join(row) or 'none'}); {COLUMN_HINT}.")
    value = row[column]
    if value is not None and not isinstance(value, str):
        strings = ", ".join(name for name, v in row.items() if isinstance(v, str)) or "none"
        raise DataError(
            f"Column {column!r} of {spec} holds {type(value).__name__} values, not strings (its string columns: "
            f"{strings}); {COLUMN_HINT}."
        )
    return value


def details(spec: HubSpec, requested: str | None) -> dict[str, Any]:
    """What provenance records of a pinned spec: name, config, split, the revision asked for, its commit."""
    return {"name": spec.name, "config": spec.config, "split": spec.split, "revision": requested or "main",
            "commit": spec.revision if spec.pinned else None}  # fmt: skip
