"""A reader per format of `data.sources` (text, JSON lines, Parquet, saved and Hub datasets): each streams its
text as `Piece`s, in order, in bounded memory. Empty and null texts are skipped, but a source of documents that
yields none is an error (far more often a wrong column than intended). pyarrow, datasets and huggingface_hub
are imported only when such a source is read."""

from __future__ import annotations

import gzip
import importlib
import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

from posgpt.data.errors import DataError

if TYPE_CHECKING:
    from posgpt.data.sources import HubSpec

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


def text_pieces(path: Path, errors: str) -> Iterator[Piece]:
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


def jsonl_pieces(path: Path, column: str, errors: str) -> Iterator[Piece]:
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
                if value := _json_text(path, number, line, column, errors):
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


def parquet_pieces(path: Path, column: str) -> Iterator[Piece]:
    """The rows' `column`, a batch of rows at a time."""
    pa = optional_import("pyarrow", f"Reading the Parquet file {path}", "parquet")
    pq = optional_import("pyarrow.parquet", f"Reading the Parquet file {path}", "parquet")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"Cannot read {path} as Parquet ({first_line(error)}); pass a valid Parquet file.") from None
    schema = parquet.schema_arrow
    kinds = {name: schema.field(name).type for name in schema.names}  # dictionary-encoded: its values' type
    kinds = {name: kind.value_type if pa.types.is_dictionary(kind) else kind for name, kind in kinds.items()}
    view = getattr(pa.types, "is_string_view", lambda _: False)
    strings = {name: bool(pa.types.is_string(k) or pa.types.is_large_string(k) or view(k)) for name, k in kinds.items()}
    _check_column(path, column, strings, str(schema.field(column).type) if column in strings else "")
    batches = (b.column(0).to_pylist() for b in parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=[column]))
    try:
        yield from _row_pieces(path, column, batches, path.stat().st_size, parquet.metadata.num_rows)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"Cannot read {path}: {first_line(error)} (a damaged Parquet file?).") from None


def saved_dataset_pieces(path: Path, column: str, size: int) -> Iterator[Piece]:
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


def _no_documents(where: Path, column: str) -> DataError:
    return DataError(f"{where} has no documents (no non-empty {column!r} values); pass one with text or {COLUMN_HINT}.")
