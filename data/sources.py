"""What `--data.input` names, as `Source`s (the table of inputs is in docs/data.md), and a reader per format
(text, JSON lines, Parquet, saved and Hub datasets): each streams its text as `Piece`s, in order, in bounded
memory. Files are recognised by suffix; documents keep the order of the files and of the rows within them.
Empty and null texts are skipped, but a source of documents that yields none is an error (far more often a
wrong column than intended). pyarrow, datasets and huggingface_hub are imported only when such a source is read.

A Hub dataset (`hf:NAME[:CONFIG]:SPLIT[@REVISION]`) is streamed at the commit its revision names when it is
first resolved: the fingerprint, meta.json and checkpoints take the pinned spec, so finding the data again
needs no network.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, NamedTuple

from posgpt.core.files import sha256_file
from posgpt.data.errors import DataError

Format = Literal["text", "jsonl", "parquet", "saved-dataset", "hub"]
DOCUMENT_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")  # what `Dataset.save_to_disk` writes beside its Arrow files
HUB_PREFIX = "hf:"
HUB_SYNTAX = "hf:NAME[:CONFIG]:SPLIT[@REVISION]"
_COMMIT = re.compile(r"[0-9a-f]{40}")
CHUNK_CHARS = 1 << 20  # characters per piece of a text file (more where a line is longer)
ROWS_PER_BATCH = 1024
COLUMN_HINT = "pass --data.text_column NAME"


class Piece(NamedTuple):
    """A stretch of a source's text, in order."""

    text: str
    end: bool
    """A document ends after this text (<|endoftext|> follows in BPE)."""
    read: int
    """Bytes of the source read so far (for a Hub dataset: characters of text), for progress."""


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
        """The text, in order, a piece at a time."""
        if self.format == "text":
            return _text_pieces(self.path, errors)
        column = self.column or "text"
        if self.format == "jsonl":
            return _jsonl_pieces(self.path, column, errors)
        if self.format == "parquet":
            return _parquet_pieces(self.path, column)
        if self.format == "saved-dataset":
            return _saved_dataset_pieces(self.path, column, self.size() or 0)
        return _hub_pieces(HubSpec.parse(self.location), column)

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
    spec = HubSpec.parse(text)
    pinned = spec
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
    if location.startswith(HUB_PREFIX):
        return False  # pinned: never changes
    path = Path(location)
    if path.is_dir():
        return any(not p.is_file() or p.stat().st_mtime > stamp for p in saved_dataset_files(path))
    return not path.is_file() or path.stat().st_mtime > stamp


def optional_import(module: str, purpose: str, extra: str) -> ModuleType:
    """`module`, or one DataError that names the pip command installing it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise DataError(
            f"{purpose} needs the {package} package, which is not installed: pip install 'posgpt[{extra}]' "
            f"(or pip install {package})."
        ) from None


def first_line(error: BaseException) -> str:
    """The first line of an error's message (libraries' messages run to many lines)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _text_pieces(path: Path, errors: str) -> Iterator[Piece]:
    """A text file in pieces; the last, empty one ends the file's document."""
    try:
        with open(path, encoding="utf-8", errors=errors, newline="") as f:
            while chunk := f.read(CHUNK_CHARS):
                if not chunk.endswith("\n"):
                    chunk += f.readline()
                if "\x00" in chunk:
                    raise DataError(f"{path} looks like a binary file (it contains NUL bytes); pass text files.")
                yield Piece(chunk, False, f.buffer.tell())
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path} is not valid UTF-8 ({error.reason}, byte value {error.object[error.start]:#04x}). "
            "Convert it to UTF-8, or pass --data.errors replace to replace invalid bytes."
        ) from None
    yield Piece("", True, path.stat().st_size)


def _jsonl_pieces(path: Path, column: str, errors: str) -> Iterator[Piece]:
    """Each line's `column`, one document a line; `.gz` files are decompressed as they are read."""
    with open(path, "rb") as raw:
        plain = not path.name.endswith(".gz")
        if plain and b"\x00" in raw.read(1 << 13):
            raise DataError(f"{path} looks like a binary file (it contains NUL bytes); pass JSON-lines text.")
        raw.seek(0)
        lines: Iterable[bytes] = raw if plain else gzip.GzipFile(fileobj=raw, mode="rb")
        documents, read = 0, 0
        try:
            for number, line in enumerate(lines, 1):
                read = read + len(line) if plain else raw.tell()
                value = _json_text(path, number, line, column, errors)
                if value:
                    documents += 1
                    yield Piece(value, True, read)
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            raise DataError(f"{path} is not a readable gzip file ({error}); recompress it or pass the .jsonl") from None
    if not documents:
        raise _no_documents(path, column)


def _json_text(path: Path, number: int, line: bytes, column: str, errors: str) -> str | None:
    """The text of one JSON line (None: a blank line, or a null text)."""
    if not line.strip():
        return None
    where = f"{path}:{number}"
    if b"\x00" in line:
        raise DataError(f"{where} holds NUL bytes: {path} looks like a binary file, not JSON lines.")
    try:
        row = json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8", errors))
    except UnicodeDecodeError as error:
        raise DataError(
            f"{where} is not valid UTF-8 ({error.reason}, byte value {error.object[error.start]:#04x}). "
            "Convert the file to UTF-8, or pass --data.errors replace to replace invalid bytes."
        ) from None
    except json.JSONDecodeError as error:
        raise DataError(
            f"{where}: invalid JSON ({error.msg} at column {error.colno}); each line of a JSON-lines file must be "
            "one JSON object."
        ) from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a JSON {type(row).__name__} where an object with a {column!r} field belongs.")
    if column not in row:
        fields = ", ".join(map(repr, row)) or "none"
        raise DataError(f"{where} has no {column!r} field (its fields: {fields}); {COLUMN_HINT}.")
    value = row[column]
    if value is not None and not isinstance(value, str):
        raise DataError(
            f"{where}: field {column!r} holds a JSON {type(value).__name__}, not a string; {COLUMN_HINT} "
            "naming the text."
        )
    return value


def _parquet_pieces(path: Path, column: str) -> Iterator[Piece]:
    """The rows' `column`, a batch of rows at a time."""
    pa = optional_import("pyarrow", f"Reading the Parquet file {path}", "parquet")
    pq = optional_import("pyarrow.parquet", f"Reading the Parquet file {path}", "parquet")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"Cannot read {path} as Parquet ({first_line(error)}); pass a valid Parquet file.") from None
    schema = parquet.schema_arrow
    strings = {name: _is_string(pa, schema.field(name).type) for name in schema.names}
    _check_column(path, column, strings, str(schema.field(column).type) if column in strings else "")
    batches = (b.column(0).to_pylist() for b in parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=[column]))
    try:
        yield from _row_pieces(path, column, batches, path.stat().st_size, parquet.metadata.num_rows)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"Cannot read {path}: {first_line(error)} (a damaged Parquet file?).") from None


def _saved_dataset_pieces(path: Path, column: str, size: int) -> Iterator[Piece]:
    """The rows' `column` of a dataset saved with `datasets`' save_to_disk (memory-mapped Arrow files)."""
    datasets = optional_import("datasets", f"Reading the saved dataset {path}", "hf")
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as error:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid, ...
        raise DataError(f"Cannot load the dataset saved in {path} ({first_line(error)}); save it again.") from None
    features = dataset.features
    strings = {
        name: isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
        for name, feature in features.items()
    }
    _check_column(path, column, strings, str(features.get(column, "")))
    batches = (batch[column] for batch in dataset.select_columns([column]).iter(batch_size=ROWS_PER_BATCH))
    yield from _row_pieces(path, column, batches, size, len(dataset))


def _hub_pieces(spec: HubSpec, column: str) -> Iterator[Piece]:
    """The split's rows' `column`, streamed in order; `read` counts characters of text."""
    datasets = optional_import("datasets", f"Reading {spec}", "hf")
    try:
        rows = datasets.load_dataset(spec.name, spec.config, split=spec.split, streaming=True, revision=spec.revision)
    except Exception as error:  # unknown config or split, no network: datasets raises many types
        raise DataError(f"Cannot stream {spec} ({type(error).__name__}: {first_line(error)}).") from None
    read, documents = 0, 0
    try:
        for row in rows:
            value = row.get(column)
            if column not in row or not (value is None or isinstance(value, str)):
                strings = {name: isinstance(v, str) for name, v in row.items()}
                _check_column(spec, column, strings, f"{type(value).__name__} values")
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


def _row_pieces(path: Path, column: str, batches: Iterable[list], size: int, rows: int) -> Iterator[Piece]:
    """Each non-empty value of the batches of a column of `rows` rows a document; `read` in proportion."""
    done, documents = 0, 0
    for values in batches:
        done += len(values)
        read = size * done // max(rows, 1)
        for value in values:
            if value:
                documents += 1
                yield Piece(value, True, read)
    if not documents:
        raise _no_documents(path, column)


def _check_column(where: Path | HubSpec, column: str, strings: dict[str, bool], kind: str) -> None:
    """A missing or non-string text column as one message listing the columns there are."""
    if column not in strings:
        names = ", ".join(strings) or "none"
        raise DataError(f"{where} has no column {column!r} (its columns: {names}); {COLUMN_HINT}.")
    if not strings[column]:
        text_columns = ", ".join(name for name, is_text in strings.items() if is_text) or "none"
        raise DataError(
            f"Column {column!r} of {where} holds {kind}, not strings (its string columns: {text_columns}); "
            f"{COLUMN_HINT}."
        )


def _is_string(pa: Any, kind: Any) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    view = getattr(pa.types, "is_string_view", lambda _: False)
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or view(kind))


def _no_documents(where: Path, column: str) -> DataError:
    return DataError(f"{where} has no documents (no non-empty {column!r} values); pass one with text or {COLUMN_HINT}.")
