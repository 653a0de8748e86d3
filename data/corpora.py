"""Named corpora, text a run can use without the user providing any: `shakespeare`, `python-docs`,
`python-library` and `auto` (docs/data.md). Each becomes a file in the cache directory ($POSGPT_CACHE, else
~/.cache/posgpt), so the rest of the pipeline treats it like any file.

`python-library` is tens of millions of GPT-2 tokens that every machine with the project installed already
holds, so BPE models can be trained at a real scale with no network: the Python source and docs (`SUFFIXES`)
of the standard library and every installed distribution, one document per file, deduplicated by content and
ordered by content hash (so the validation split samples every package), built once into the cache as JSON
lines under a name keyed by the installation, with a manifest beside it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import site
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from posgpt.core.files import atomic_file, atomic_write_bytes, sha256_file, waiting_lock
from posgpt.data.errors import DataError
from posgpt.data.sources import Source

log = logging.getLogger(__name__)

AUTO = "auto"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
CACHE_ENV = "POSGPT_CACHE"
STDLIB_SOURCE_CHARS = 1 << 20  # how much of the standard library's source stands in for missing docs
LIBRARY = "python-library"
BUILDER_VERSION = 2  # changes whenever the rules below change what the corpus holds
SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt")
MAX_FILE_BYTES = 1 << 20  # larger files are generated data (tables, vendored bundles)
SKIPPED_DIRECTORY_SUFFIXES = (".dist-info", ".egg-info")
INDENTATION = re.compile(r"^(?: {4})+", re.MULTILINE)


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
        path, make = cache_dir() / f"python-stdlib-{version}.txt", _stdlib_source
    else:
        path, make = cache_dir() / f"python-docs-{version}.txt", lambda: "\n".join(topics[k] for k in sorted(topics))
    if not path.is_file():
        _write_to_cache(path, make().encode("utf-8"))
    return path


@functools.cache  # once per cache directory: a study of many runs tries the download and says so once
def _default_corpus(cache: Path) -> Path:
    """`auto`: Tiny Shakespeare where it can be had, else Python's documentation, saying so in one line."""
    try:
        return shakespeare_path()
    except DataError as error:
        path = python_docs_path()
        log.warning(
            "%s: training on Python's bundled documentation instead (%s, %d KB). Pass your own text as the "
            "data.input option (a file, or the path of tinyshakespeare.txt).",
            str(error).split(";")[0], path.name, path.stat().st_size // 1024,
        )  # fmt: skip
        return path


def python_library() -> Source:
    """`python-library` of this installation, built into the cache the first time."""
    roots, cache = library_roots(), cache_dir()
    try:  # the cache directory is made where missing by the lock on it
        return library_corpus(roots, cache, installed_environment(roots), exclude=[Path("prepared"), Path("runs")])
    except OSError as error:
        raise DataError(f"Cannot write {cache} ({error}); set {CACHE_ENV} to a writable directory.") from None


NAMED: dict[str, Callable[[], Path | Source]] = {
    "shakespeare": shakespeare_path,
    "python-docs": python_docs_path,
    LIBRARY: python_library,
    AUTO: lambda: _default_corpus(cache_dir()),
}


def _stdlib_source() -> str:
    text = ""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= STDLIB_SOURCE_CHARS:
            break
    if not text:
        raise DataError("This Python installation carries neither pydoc_data nor its library's source.")
    return text[:STDLIB_SOURCE_CHARS]


def _write_to_cache(path: Path, payload: bytes) -> None:
    try:
        with waiting_lock(path.parent):  # what a killed download or build left goes first
            atomic_write_bytes(path, payload)
    except OSError as error:
        raise DataError(f"Cannot write {path} ({error}); set {CACHE_ENV} to a writable directory.") from None


def library_roots() -> list[Path]:
    """The standard library and every site-packages directory (system, user, virtual environment)."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    resolved = (Path(candidate).resolve() for candidate in candidates)
    return list(dict.fromkeys(path for path in resolved if path.is_dir()))  # without repeats, in order


def installed_environment(roots: Sequence[Path]) -> dict[str, Any]:
    """What the corpus depends on besides its roots: the Python version and the distributions in the roots."""
    distributions: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=[str(root) for root in roots]):
        if name := dist.metadata["Name"]:
            distributions.setdefault(name, dist.version)
    return {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "distributions": dict(sorted(distributions.items(), key=lambda item: item[0].lower())),
    }


def library_corpus(
    roots: Sequence[Path], cache: Path, environment: dict[str, Any], exclude: Iterable[Path] = ()
) -> Source:
    """The corpus of `roots`, built into `cache` unless one of the same roots and `environment` is there."""
    roots = [Path(root).resolve() for root in roots]
    key_text = json.dumps({"builder": BUILDER_VERSION, "roots": [str(r) for r in roots], **environment}, sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    version = ".".join(environment["python"].split(".")[:2])
    stem = f"{LIBRARY}-{version}-{key}"
    corpus, manifest_path = cache / f"{stem}.jsonl", cache / f"{stem}.manifest.json"
    if (manifest := _read_manifest(manifest_path, corpus)) is None:
        with waiting_lock(cache):  # one build at a time; what a killed one left goes first
            if (manifest := _read_manifest(manifest_path, corpus)) is None:  # else built by the holder we waited for
                manifest = build(roots, corpus, environment, exclude=[cache, *exclude])
                atomic_write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
    return Source(str(corpus.resolve()), "jsonl", "text", label=f"{LIBRARY}-{version}", details={"manifest": manifest})


def build(roots: list[Path], out: Path, environment: dict[str, Any], exclude: Iterable[Path] = ()) -> dict[str, Any]:
    """Write the corpus of the (resolved) `roots` to `out` (JSON lines, atomically) and return its manifest."""
    start = time.perf_counter()
    log.info("Building the %s corpus from %d directories into %s (once per installation)", LIBRARY, len(roots), out)
    skipped: Counter[str] = Counter()
    kept: dict[str, tuple[Path, Path]] = {}  # content sha256 -> the first path holding it, and its root
    checked = 0
    for root, path in _candidates(roots, {Path(p).resolve() for p in exclude}, skipped):
        if (data := _checked_bytes(path, skipped)) is not None:
            checked += 1
            kept.setdefault(hashlib.sha256(data).hexdigest(), (path, root))
    duplicates = checked - len(kept)
    whole, text_bytes = hashlib.sha256(), 0
    with atomic_file(out) as f:
        for digest, (path, root) in sorted(kept.items()):  # content-hash order: deterministic, packages scattered
            try:  # once more: the first pass kept only hashes, and the hash proves these are the bytes it checked
                data = path.read_bytes()
            except OSError:
                data = b""
            if hashlib.sha256(data).hexdigest() != digest:
                raise DataError(f"{path} changed while the {LIBRARY} corpus was being built; run the command again.")
            # each line's leading groups of four spaces as tabs: GPT-2's BPE spends a token per space
            text = INDENTATION.sub(lambda match: "\t" * (len(match.group(0)) // 4), data.decode("utf-8"))
            label = f"{root.name}/{path.relative_to(root).as_posix()}"  # python3.11/json/decoder.py
            payload = (json.dumps({"text": text, "path": label}, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(payload)
            whole.update(payload)
            text_bytes += len(text.encode("utf-8"))
    seconds = time.perf_counter() - start
    log.info("Built %s: %d files, %.1f MB of text, %d duplicates dropped, in %.1f s",
             out.name, len(kept), text_bytes / 1e6, duplicates, seconds)  # fmt: skip
    return {
        "corpus": LIBRARY,
        "builder": BUILDER_VERSION,
        **environment,
        "roots": [str(root) for root in roots],
        "suffixes": list(SUFFIXES),
        "max_file_bytes": MAX_FILE_BYTES,
        "indentation": "leading groups of 4 spaces as tabs",
        "files": len(kept),
        "duplicates_dropped": duplicates,
        "skipped": dict(sorted(skipped.items())),
        "text_bytes": text_bytes,
        "file": out.name,
        "file_bytes": out.stat().st_size,
        "sha256": whole.hexdigest(),
        "build_seconds": round(seconds, 1),
    }


def _candidates(roots: list[Path], exclude: set[Path], skipped: Counter[str]) -> Iterator[tuple[Path, Path]]:
    """(root, file) of the files with a corpus suffix under each root, not under other roots (so the root is the
    file's innermost), excluded directories or caches."""
    for root in roots:
        others = {r for r in roots if r != root} | exclude
        for directory, subdirectories, files in os.walk(root):
            here = Path(directory)
            subdirectories[:] = sorted(
                name
                for name in subdirectories
                if not name.startswith(".")
                and name != "__pycache__"
                and not name.endswith(SKIPPED_DIRECTORY_SUFFIXES)
                and (here / name) not in others
            )
            for path in (here / name for name in sorted(files) if name.endswith(SUFFIXES)):
                if path.is_symlink():
                    skipped["symlink"] += 1
                else:
                    yield root, path


def _checked_bytes(path: Path, skipped: Counter[str]) -> bytes | None:
    """The file's bytes if it belongs in the corpus, else None (counting why not)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            reason = "too_large"
        elif b"\x00" in (data := path.read_bytes()):
            reason = "binary"
        elif data.decode("utf-8").strip():
            return data
        else:
            reason = "empty"
    except OSError:
        reason = "unreadable"
    except UnicodeDecodeError:
        reason = "not_utf8"
    skipped[reason] += 1
    return None


def _read_manifest(path: Path, corpus: Path) -> dict[str, Any] | None:
    """The manifest of a complete corpus file, else None (then it is built again)."""
    try:
        manifest = json.loads(path.read_text())
        complete = manifest["corpus"] == LIBRARY and manifest["file_bytes"] == corpus.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest if complete else None
