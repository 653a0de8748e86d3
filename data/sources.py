"""What `--data.input` names, as `Source`s (the table of inputs is in docs/data.md), each read by its format's
reader (`data.readers`). Files are recognised by suffix; documents keep the order of the files and of the rows
within them.

A Hub dataset (`hf:NAME[:CONFIG]:SPLIT[@REVISION]`) is streamed at the commit its revision names when it is
first resolved: the fingerprint, meta.json and checkpoints take the pinned spec, so finding the data again
needs no network.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from posgpt.core.files import sha256_file
from posgpt.data.errors import DataError
from posgpt.data.readers import (
    Piece,
    first_line,
    hub_pieces,
    jsonl_pieces,
    optional_import,
    parquet_pieces,
    saved_dataset_pieces,
    text_pieces,
)

Format = Literal["text", "jsonl", "parquet", "saved-dataset", "hub"]
DOCUMENT_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")  # what `Dataset.save_to_disk` writes beside its Arrow files
HUB_PREFIX = "hf:"
HUB_SYNTAX = "hf:NAME[:CONFIG]:SPLIT[@REVISION]"
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
        body, at, revision = text.removeprefix(HUB_PREFIX).partition("@")
        parts = body.split(":")
        if len(parts) not in (2, 3) or not all(parts) or (at and not revision):
            raise DataError(
                f"Cannot read the Hub dataset {text!r}: write {HUB_SYNTAX}, e.g. hf:Salesforce/wikitext:"
                "wikitext-103-raw-v1:train (the split is required)."
            )
        return cls(parts[0], parts[1] if len(parts) == 3 else None, parts[-1], revision or None)

    def __str__(self) -> str:
        config = f":{self.config}" if self.config else ""
        revision = f"@{self.revision}" if self.revision else ""
        return f"{HUB_PREFIX}{self.name}{config}:{self.split}{revision}"

    @property
    def pinned(self) -> bool:
        """Whether the revision is a full commit hash."""
        return bool(self.revision and _COMMIT.fullmatch(self.revision))


@dataclass(frozen=True)
class Source:
    """One input of a corpus."""

    location: str
    """The resolved path; for a Hub dataset its `hf:` spec pinned to a commit."""
    format: Format
    column: str | None = None
    """The text column of the formats of documents; None for text files."""
    label: str | None = None
    """The name of directories and runs prepared from it (default: from the location)."""
    details: dict[str, Any] = field(default_factory=dict, compare=False)
    """What records say of it besides: a Hub dataset's revision and commit, a named corpus' manifest."""

    @property
    def path(self) -> Path:
        return Path(self.location)

    @property
    def name(self) -> str:
        """A short name: a text file's stem, a document file's with its format (code.jsonl: code-jsonl)."""
        if self.label:
            return self.label
        if self.format == "hub":
            return HubSpec.parse(self.location).name.rsplit("/", 1)[-1]
        name = self.path.name
        for suffix in DOCUMENT_SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)] + suffix.replace(".", "-")
        return self.path.stem if self.format == "text" else name

    @cached_property
    def digest(self) -> bytes:
        """What the fingerprint of prepared data takes from this source: its location and content hash (a Hub
        dataset: the pinned spec), with format and column except for text files (as before formats existed);
        hashed once per `Source`."""
        tag = (self.location if self.format == "text" else f"{self.format}:{self.column}:{self.location}").encode()
        if self.format == "hub":
            return tag
        if self.format != "saved-dataset":
            return tag + b"\0" + sha256_file(self.path).encode()
        digest = hashlib.sha256()  # the files' relative paths and contents
        for path in saved_dataset_files(self.path):
            digest.update(str(path.relative_to(self.path)).encode() + b"\0" + sha256_file(path).encode() + b"\n")
        return tag + b"\0" + digest.hexdigest().encode()

    def size(self) -> int | None:
        """Bytes on disk (None for a Hub dataset), for progress."""
        if self.format == "hub":
            return None
        if self.format == "saved-dataset":
            return sum(p.stat().st_size for p in saved_dataset_files(self.path))
        return self.path.stat().st_size

    def pieces(self, errors: str = "strict") -> Iterator[Piece]:
        """The text, in order, a piece at a time."""
        if self.format == "text":
            return text_pieces(self.path, errors)
        column = self.column or "text"
        if self.format == "jsonl":
            return jsonl_pieces(self.path, column, errors)
        if self.format == "parquet":
            return parquet_pieces(self.path, column)
        if self.format == "saved-dataset":
            return saved_dataset_pieces(self.path, column, self.size() or 0)
        return hub_pieces(HubSpec.parse(self.location), column)

    def record(self) -> dict[str, Any]:
        """What meta.json and checkpoints record of it; `from_record` reads it back."""
        fields = {"source": self.location, "format": self.format, "column": self.column, "label": self.label or None}
        return {**{key: value for key, value in fields.items() if value is not None}, **self.details}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Source:
        """The source `record` describes (no network: a Hub source is recorded pinned)."""
        extra = {k: v for k, v in record.items() if k not in ("source", "format", "column", "label")}
        return cls(record["source"], record["format"], record.get("column"), record.get("label"), extra)


def file_source(path: Path, column: str) -> Source:
    """A file, read by its suffix."""
    path = path.resolve()
    kind = next((kind for suffix, kind in DOCUMENT_SUFFIXES.items() if path.name.lower().endswith(suffix)), None)
    return Source(str(path), kind, column) if kind else Source(str(path), "text")


def hub_source(text: str, column: str) -> Source:
    """A Hub dataset's split, pinned to the commit its revision names now (asking the Hub, unless it is one)."""
    spec = pinned = HubSpec.parse(text)
    if not spec.pinned:
        hub = optional_import("huggingface_hub", f"Reading {spec}", "hf")
        optional_import("datasets", f"Reading {spec}", "hf")  # fail before anything is prepared
        try:
            commit = hub.HfApi().dataset_info(spec.name, revision=spec.revision).sha
        except Exception as error:  # offline, unknown dataset or revision: huggingface_hub raises many types
            raise DataError(
                f"Cannot find {spec} on the Hugging Face Hub ({type(error).__name__}: {first_line(error)}). Check "
                "the name and revision. Offline, data prepared online is reused through the pinned spec its "
                "meta.json records (hf:...@COMMIT) or --data.dir DIR; or pass a dataset saved with save_to_disk."
            ) from None
        pinned = replace(spec, revision=commit) if commit else spec
    details = {"name": spec.name, "config": spec.config, "split": spec.split, "revision": spec.revision or "main",
               "commit": pinned.revision if pinned.pinned else None}  # fmt: skip
    return Source(str(pinned), "hub", column, details=details)


def is_saved_dataset(path: Path) -> bool:
    return all((path / name).is_file() for name in SAVED_DATASET_FILES)


def saved_dataset_files(path: Path) -> list[Path]:
    """Its state, info and the Arrow files its state lists (not cache files); all, where the state is unreadable."""
    try:
        data = [path / entry["filename"] for entry in json.loads((path / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path / name for name in SAVED_DATASET_FILES] + data


def path_sources(path: Path, glob: str, column: str) -> list[Source]:
    """The sources of an existing file or directory: a saved dataset, or the files matching `glob` in it."""
    if path.is_file():
        return [file_source(path, column)]
    if is_saved_dataset(path):
        return [Source(str(path.resolve()), "saved-dataset", column)]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir() and is_saved_dataset(p))
        raise DataError(
            f"{path} holds a DatasetDict with the splits {', '.join(splits) or 'none'}: pass one split's directory, "
            f"e.g. --data.input {path / (splits[0] if splits else 'train')}."
        )
    found = sorted(p for p in path.rglob(glob) if p.is_file())
    if not found:
        suffix = next((s for s in DOCUMENT_SUFFIXES if next(path.rglob(f"*{s}"), None) is not None), None)
        hint = f" (it has {suffix} files: --data.glob '*{suffix}')" if suffix else ""
        raise DataError(f"Directory {path} has no files matching {glob!r}; pass --data.glob PATTERN{hint}.")
    return [file_source(p, column) for p in found]


def corpus_name(sources: list[Source]) -> str:
    """The name of prepared directories: the one source's, or the directory of the first of several."""
    first = sources[0]
    return first.name if len(sources) == 1 or first.format == "hub" else first.path.parent.name


def modified_after(location: str, stamp: float) -> bool:
    """Whether a recorded source changed (or vanished) after `stamp`: a stat of each file, no hashing."""
    if location.startswith(HUB_PREFIX):
        return False  # pinned: never changes
    path = Path(location)
    files = saved_dataset_files(path) if path.is_dir() else [path]
    return any(not p.is_file() or p.stat().st_mtime > stamp for p in files)
