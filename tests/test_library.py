"""`python-library`: built from the roots it is given (here a few files the test writes), deduplicated by
content, in content-hash order, with a manifest; built again only when the installation changes; a named
corpus that prepares into one document per file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from posgpt.data import corpora
from posgpt.data.dataset import load_prepared
from posgpt.data.prepare import prepare, resolve_sources
from posgpt.data.tokenizer import GPT2Tokenizer

ENVIRONMENT = {"python": "3.11.7", "implementation": "cpython", "distributions": {"numpy": "2.1.0"}}


def _write(path: Path, payload: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload.encode() if isinstance(payload, str) else payload)


@pytest.fixture
def roots(tmp_path, monkeypatch) -> list[Path]:
    """A standard library with a site-packages inside it (walked as its own root, not twice)."""
    monkeypatch.setattr(corpora, "MAX_FILE_BYTES", 200)
    stdlib, site = tmp_path / "lib" / "python3.11", tmp_path / "lib" / "python3.11" / "site-packages"
    _write(stdlib / "os.py", "import sys\n")
    _write(stdlib / "json" / "README.md", "# json\nThe json module.\n")
    _write(stdlib / "json" / "decoder.py", "def decode(s):\n    if s:\n        return s\n      # two\n")
    _write(stdlib / "__pycache__" / "os.cpython-311.py", "cached\n")  # a cache: not walked
    _write(site / "pkg" / "__init__.py", "")  # empty: skipped
    _write(site / "pkg" / "copy_of_os.py", "import sys\n")  # a duplicate of os.py
    _write(site / "pkg" / "guide.rst", "Guide\n=====\n")
    _write(site / "pkg" / "table.txt", "1 2 3\n" * 100)  # 600 bytes > MAX_FILE_BYTES: generated data
    _write(site / "pkg" / "blob.py", b"\x00\x01binary")
    _write(site / "pkg" / "latin.txt", b"caf\xe9\n")
    _write(site / "pkg" / "data.json", "{}")  # not a corpus suffix
    _write(site / "pkg-1.0.dist-info" / "LICENSE.txt", "MIT\n")  # metadata: not walked
    return [stdlib, site]


KEPT = ["import sys\n", "# json\nThe json module.\n", "def decode(s):\n    if s:\n        return s\n      # two\n",
        "Guide\n=====\n"]  # fmt: skip
TABBED = {
    "def decode(s):\n    if s:\n        return s\n      # two\n": "def decode(s):\n\tif s:\n\t\treturn s\n\t  # two\n"
}
"""What the corpus holds of a file: leading groups of four spaces as tabs."""


def _documents(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_corpus_is_deduplicated_in_content_hash_order_with_a_manifest(roots, tmp_path):
    source = corpora.library_corpus(roots, tmp_path / "cache", ENVIRONMENT)
    assert source.format == "jsonl" and source.column == "text" and source.label == "python-library-3.11"
    documents = _documents(source.path)
    expected = sorted(KEPT, key=lambda text: hashlib.sha256(text.encode()).hexdigest())
    assert [d["text"] for d in documents] == [TABBED.get(text, text) for text in expected]
    assert {d["path"] for d in documents} >= {"python3.11/os.py", "site-packages/pkg/guide.rst"}
    manifest = source.details["manifest"]
    assert manifest == json.loads(source.path.with_suffix(".manifest.json").read_text())
    assert {k: manifest[k] for k in ("files", "duplicates_dropped", "skipped", "text_bytes", "python")} == {
        "files": 4,
        "duplicates_dropped": 1,
        "skipped": {"binary": 1, "empty": 1, "not_utf8": 1, "too_large": 1},
        "text_bytes": sum(len(TABBED.get(text, text).encode()) for text in KEPT),
        "python": "3.11.7",
    }
    assert manifest["distributions"] == {"numpy": "2.1.0"} and manifest["roots"] == [str(r) for r in roots]
    assert manifest["sha256"] == hashlib.sha256(source.path.read_bytes()).hexdigest()


def test_it_is_built_again_only_when_the_installation_changes(roots, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = corpora.library_corpus(roots, cache, ENVIRONMENT)
    stamp = first.path.stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("an unchanged installation must reuse its corpus")

    with monkeypatch.context() as patch:
        patch.setattr(corpora, "build", no_build)
        again = corpora.library_corpus(roots, cache, ENVIRONMENT)
    assert again == first and again.details == first.details and first.path.stat().st_mtime_ns == stamp
    upgraded = corpora.library_corpus(roots, cache, {**ENVIRONMENT, "distributions": {"numpy": "2.2.0"}})
    assert upgraded.path != first.path and upgraded.path.read_bytes() == first.path.read_bytes()
    first.path.write_bytes(first.path.read_bytes()[:-5])  # torn: its size no longer the manifest's
    assert corpora.library_corpus(roots, cache, ENVIRONMENT).path.stat().st_size == len(upgraded.path.read_bytes())


def test_a_build_removes_what_a_killed_build_left_in_the_cache(roots, tmp_path, monkeypatch):
    """A SIGTERM skips a build's clean-up and leaves its temporary file (88 MB for the real corpus): the
    next build, holding the cache's lock, removes it; so does the next download into the cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = [cache / "python-library-3.11-0123456789ab.jsonl.tmp4242", cache / "x.txt.tmp7"]
    for path in stale:
        path.write_bytes(b"{}" * 1000)
    corpora.library_corpus(roots, cache, ENVIRONMENT)
    assert not any(path.exists() for path in stale)
    stale[1].write_bytes(b"partial")
    monkeypatch.setenv(corpora.CACHE_ENV, str(cache))
    corpora._write_to_cache(cache / "made.txt", b"made")
    assert not stale[1].exists() and (cache / "made.txt").read_text() == "made"


def test_the_environment_lists_the_distributions_of_the_roots(tmp_path):
    _write(
        tmp_path / "site" / "Foo_Bar-1.2.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: Foo-Bar\nVersion: 1.2\n"
    )
    _write(tmp_path / "site" / "baz-0.1.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: baz\nVersion: 0.1\n")
    environment = corpora.installed_environment([tmp_path / "site"])
    assert environment["distributions"] == {"baz": "0.1", "Foo-Bar": "1.2"} and environment["python"].count(".") == 2
    assert corpora.library_roots() and all(root.is_dir() for root in corpora.library_roots())


def test_the_named_corpus_prepares_into_one_document_per_file(roots, tmp_path, monkeypatch, gpt2_ranks):
    monkeypatch.setenv("POSGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpora, "library_roots", lambda: roots)
    monkeypatch.setattr(corpora, "installed_environment", lambda roots: ENVIRONMENT)
    (source,) = resolve_sources("python-library")
    assert source.path.parent == tmp_path / "cache" and source.details["manifest"]["files"] == 4
    meta = prepare("python-library", str(tmp_path / "out"), "gpt2", tiktoken_ranks=str(gpt2_ranks), val_fraction=0.0)
    tok = GPT2Tokenizer(gpt2_ranks)
    expected = sorted(KEPT, key=lambda text: hashlib.sha256(text.encode()).hexdigest())
    assert load_prepared(tmp_path / "out").tokens("train").tolist() == [
        i for text in expected for i in [*tok.encode(TABBED.get(text, text)), tok.end_id]
    ]
    (detail,) = meta["source_details"]
    assert detail["label"] == "python-library-3.11" and detail["manifest"]["duplicates_dropped"] == 1
    assert meta["name"] == "python-library-3.11"
