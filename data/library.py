"""`python-library`: tens of millions of GPT-2 tokens that every machine with the project installed already
holds, so BPE models can be trained at a real scale with no network (docs/data.md). It is the Python source
and docs (`SUFFIXES`) of the standard library and every installed distribution, one document per file,
deduplicated by content and ordered by content hash (so the validation split samples every package), built
once into the cache as JSON lines under a name keyed by the installation, with a manifest beside it.
"""

from __future__ import annotations

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
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from core.files import atomic_file, atomic_write_bytes, waiting_lock
from data.errors import DataError
from data.sources import Source

log = logging.getLogger(__name__)

NAME = "python-library"
BUILDER_VERSION = 2  # changes whenever the rules below change what the corpus holds
SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt")
MAX_FILE_BYTES = 1 << 20  # larger files are generated data (tables, vendored bundles)
SKIPPED_DIRECTORY_SUFFIXES = (".dist-info", ".egg-info")
INDENTATION = re.compile(r"^(?: {4})+", re.MULTILINE)


def tabbed(text: str) -> str:
    """`text` with each line's leading groups of four spaces as tabs: GPT-2's BPE spends a token per space."""
    return INDENTATION.sub(lambda match: "\t" * (len(match.group(0)) // 4), text)


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
        name = dist.metadata["Name"]
        if name:
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
    stem = f"{NAME}-{version}-{key}"
    corpus, manifest_path = cache / f"{stem}.jsonl", cache / f"{stem}.manifest.json"
    manifest = _read_manifest(manifest_path, corpus)
    if manifest is None:
        with waiting_lock(cache):  # one build at a time; what a killed one left goes first
            manifest = _read_manifest(manifest_path, corpus)  # built by the holder we waited for
            if manifest is None:
                manifest = build(roots, corpus, environment, exclude=[cache, *exclude])
                atomic_write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
    return Source(str(corpus.resolve()), "jsonl", "text", label=f"{NAME}-{version}", details={"manifest": manifest})


def build(roots: list[Path], out: Path, environment: dict[str, Any], exclude: Iterable[Path] = ()) -> dict[str, Any]:
    """Write the corpus of the (resolved) `roots` to `out` (JSON lines, atomically) and return its manifest."""
    start = time.perf_counter()
    log.info("Building the %s corpus from %d directories into %s (once per installation)", NAME, len(roots), out)
    skipped: Counter[str] = Counter()
    kept: dict[str, Path] = {}  # content sha256 -> the first path holding it
    duplicates = 0
    for path in _candidates(roots, {Path(p).resolve() for p in exclude}, skipped):
        checked = _checked_bytes(path, skipped)
        if checked is None:
            continue
        digest = hashlib.sha256(checked).hexdigest()
        if digest in kept:
            duplicates += 1
        else:
            kept[digest] = path
    out.parent.mkdir(parents=True, exist_ok=True)
    whole, text_bytes = hashlib.sha256(), 0
    with atomic_file(out) as f:
        for digest in sorted(kept):  # content-hash order: deterministic, and packages are scattered
            data = _read_again(kept[digest], digest)
            text = tabbed(data.decode("utf-8"))
            line = json.dumps({"text": text, "path": _label(kept[digest], roots)}, ensure_ascii=False)
            payload = (line + "\n").encode("utf-8")
            f.write(payload)
            whole.update(payload)
            text_bytes += len(text.encode("utf-8"))
    seconds = time.perf_counter() - start
    log.info("Built %s: %d files, %.1f MB of text, %d duplicates dropped, in %.1f s",
             out.name, len(kept), text_bytes / 1e6, duplicates, seconds)  # fmt: skip
    return {
        "corpus": NAME,
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


def _candidates(roots: list[Path], exclude: set[Path], skipped: Counter[str]) -> Iterator[Path]:
    """Files with a corpus suffix under each root, not under other roots, excluded directories or caches."""
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
            for name in sorted(files):
                if name.endswith(SUFFIXES):
                    path = here / name
                    if path.is_symlink():
                        skipped["symlink"] += 1
                        continue
                    yield path


def _checked_bytes(path: Path, skipped: Counter[str]) -> bytes | None:
    """The file's bytes if it belongs in the corpus, else None (counting why not)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            return None
        data = path.read_bytes()
    except OSError:
        skipped["unreadable"] += 1
        return None
    if b"\x00" in data:
        skipped["binary"] += 1
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1
        return None
    if not text.strip():
        skipped["empty"] += 1
        return None
    return data


def _read_again(path: Path, digest: str) -> bytes:
    """A kept file's bytes, once more (the first pass keeps only hashes)."""
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    if hashlib.sha256(data).hexdigest() != digest:
        raise DataError(f"{path} changed while the {NAME} corpus was being built; run the command again.")
    return data


def _label(path: Path, roots: list[Path]) -> str:
    """The file's path below its innermost root, prefixed with the root's name: python3.11/json/decoder.py."""
    root = max((r for r in roots if path.is_relative_to(r)), key=lambda r: len(r.parts), default=None)
    return path.as_posix() if root is None else f"{root.name}/{path.relative_to(root).as_posix()}"


def _read_manifest(path: Path, corpus: Path) -> dict[str, Any] | None:
    """The manifest of a complete corpus file, else None (then it is built again)."""
    try:
        manifest = json.loads(path.read_text())
        size = corpus.stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("corpus") != NAME or manifest.get("file_bytes") != size:
        return None
    return manifest
