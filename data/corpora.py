"""Named corpora, text a run can use without the user providing any: `shakespeare`, `python-docs`,
`python-library` and `auto` (docs/data.md). Each becomes a file in the cache directory ($POSGPT_CACHE, else
~/.cache/posgpt), so the rest of the pipeline treats it like any file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import sysconfig
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from core.files import atomic_write_bytes, sha256_file, waiting_lock
from data.errors import DataError
from data.library import installed_environment, library_corpus, library_roots
from data.sources import Source

log = logging.getLogger(__name__)

SHAKESPEARE = "shakespeare"
PYTHON_DOCS = "python-docs"
PYTHON_LIBRARY = "python-library"
AUTO = "auto"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
CACHE_ENV = "POSGPT_CACHE"
STDLIB_SOURCE_CHARS = 1 << 20  # how much of the standard library's source stands in for missing docs


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "posgpt")


def shakespeare_path() -> Path:
    """Tiny Shakespeare from the cache, downloaded once when online."""
    path = cache_dir() / "tinyshakespeare.txt"
    if path.is_file() and sha256_file(path) == SHAKESPEARE_SHA256:
        return path
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=20) as response:
            payload = response.read()
    except (urllib.error.URLError, OSError) as error:
        raise DataError(
            f"Could not download Tiny Shakespeare ({error}); are you offline? Pass a local copy "
            f"instead: --data.input /path/to/tinyshakespeare.txt (or place it at {path})."
        ) from None
    if hashlib.sha256(payload).hexdigest() != SHAKESPEARE_SHA256:
        raise DataError(f"The download from {SHAKESPEARE_URL} is not Tiny Shakespeare (sha256 mismatch).")
    _write_to_cache(path, payload)
    log.info("Downloaded Tiny Shakespeare (%d KB) from %s into %s", len(payload) // 1024, SHAKESPEARE_URL, path)
    return path


def python_docs_path() -> Path:
    """The topics that `help()` shows (pydoc_data), else the standard library's source, cached once."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        return _cached_text(f"python-stdlib-{version}.txt", _stdlib_source)
    return _cached_text(f"python-docs-{version}.txt", lambda: "\n".join(topics[k] for k in sorted(topics)))


def default_corpus() -> Path:
    """`auto`: Tiny Shakespeare where it can be had, else Python's documentation, saying so in one line."""
    return _default_corpus(cache_dir())


@functools.cache  # once per cache directory: a study of many runs tries the download and says so once
def _default_corpus(cache: Path) -> Path:
    try:
        return shakespeare_path()
    except DataError as error:
        reason = str(error).split(";")[0]
        path = python_docs_path()
        log.warning(
            "%s: training on Python's bundled documentation instead (%s, %d KB). Pass your own text as the "
            "data.input option (a file, or the path of tinyshakespeare.txt).",
            reason,
            path.name,
            path.stat().st_size // 1024,
        )
        return path


def python_library() -> Source:
    """`python-library` of this installation, built into the cache the first time (`data.library`)."""
    roots, cache = library_roots(), cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        return library_corpus(roots, cache, installed_environment(roots), exclude=[Path("prepared"), Path("runs")])
    except OSError as error:
        raise DataError(f"Cannot write {cache} ({error}); set {CACHE_ENV} to a writable directory.") from None


NAMED: dict[str, Callable[[], Path | Source]] = {
    SHAKESPEARE: shakespeare_path,
    PYTHON_DOCS: python_docs_path,
    PYTHON_LIBRARY: python_library,
    AUTO: default_corpus,
}


def _stdlib_source() -> str:
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= STDLIB_SOURCE_CHARS:
            break
    if not parts:
        raise DataError("This Python installation carries neither pydoc_data nor its library's source.")
    return "".join(parts)[:STDLIB_SOURCE_CHARS]


def _cached_text(name: str, make: Callable[[], str]) -> Path:
    path = cache_dir() / name
    if not path.is_file():
        _write_to_cache(path, make().encode("utf-8"))
    return path


def _write_to_cache(path: Path, payload: bytes) -> None:
    try:
        with waiting_lock(path.parent):  # what a killed download or build left goes first
            atomic_write_bytes(path, payload)
    except OSError as error:
        raise DataError(f"Cannot write {path} ({error}); set {CACHE_ENV} to a writable directory.") from None
