"""What `--data.input` names, resolved into `Source`s: where the text is, in which format, which column
holds it (the table of inputs is in docs/data.md). Files are recognised by suffix; documents keep the order of
the files and of the rows within them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core.files import sha256_file
from data import hub
from data.errors import DataError
from data.readers import Piece, jsonl_pieces, parquet_pieces, saved_dataset_pieces, text_pieces

Format = Literal["text", "jsonl", "parquet", "saved-dataset", "hub"]
DOCUMENT_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")  # what `Dataset.save_to_disk` writes beside its Arrow files


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
            return hub.HubSpec.parse(self.location).name.rsplit("/", 1)[-1]
        name = self.path.name
        for suffix in DOCUMENT_SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)] + suffix.replace(".", "-")
        return self.path.stem if self.format == "text" else name

    def digest(self) -> bytes:
        """What the fingerprint of prepared data takes from this source: its location and content hash (a Hub
        dataset: the pinned spec), with format and column except for text files (as before formats existed)."""
        if self.format == "text":
            return self.location.encode() + b"\0" + sha256_file(self.path).encode()
        tag = f"{self.format}:{self.column}:{self.location}".encode()
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
        """The text, in order, a piece at a time (see `data.readers`)."""
        if self.format == "text":
            return text_pieces(self.path, errors)
        column = self.column or "text"
        if self.format == "jsonl":
            return jsonl_pieces(self.path, column, errors)
        if self.format == "parquet":
            return parquet_pieces(self.path, column)
        if self.format == "saved-dataset":
            return saved_dataset_pieces(self.path, column, self.size() or 0)
        return hub.hub_pieces(hub.HubSpec.parse(self.location), column)

    def record(self) -> dict[str, Any]:
        """What meta.json and checkpoints record of it; `from_record` reads it back."""
        record: dict[str, Any] = {"source": self.location, "format": self.format}
        if self.column is not None:
            record["column"] = self.column
        if self.label:
            record["label"] = self.label
        return {**record, **self.details}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Source:
        """The source `record` describes (no network: a Hub source is recorded pinned)."""
        extra = {k: v for k, v in record.items() if k not in ("source", "format", "column", "label")}
        return cls(record["source"], record["format"], record.get("column"), record.get("label"), extra)


def file_source(path: Path, column: str) -> Source:
    """A file, read by its suffix."""
    path = path.resolve()
    for suffix, kind in DOCUMENT_SUFFIXES.items():
        if path.name.lower().endswith(suffix):
            return Source(str(path), kind, column)
    return Source(str(path), "text")


def hub_source(text: str, column: str) -> Source:
    """A Hub dataset's split, pinned to the commit its revision names now."""
    spec = hub.HubSpec.parse(text)
    pinned = hub.pin(spec)
    return Source(str(pinned), "hub", column, details=hub.details(pinned, spec.revision))


def is_saved_dataset(path: Path) -> bool:
    return all((path / name).is_file() for name in SAVED_DATASET_FILES)


def saved_dataset_files(path: Path) -> list[Path]:
    """Its state, info and the Arrow files its state lists (not cache files); all, where the state is unreadable."""
    try:
        state = json.loads((path / "state.json").read_text())
        data = [path / entry["filename"] for entry in state["_data_files"]]
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
    if len(sources) == 1 or first.format == "hub":
        return first.name
    return first.path.parent.name


def modified_after(location: str, stamp: float) -> bool:
    """Whether a recorded source changed (or vanished) after `stamp`: a stat of each file, no hashing."""
    if location.startswith(hub.PREFIX):
        return False  # pinned: never changes
    path = Path(location)
    if path.is_dir():
        return any(not p.is_file() or p.stat().st_mtime > stamp for p in saved_dataset_files(path))
    return not path.is_file() or path.stat().st_mtime > stamp
