"""Named corpora: the default run trains offline on a corpus every Python carries, says so in one
line, and names its run after it; an explicit `shakespeare` offline still stops with the fix."""

from __future__ import annotations

import logging
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import train as train_script
from posgpt.core import cli
from posgpt.data import corpora
from posgpt.data.errors import DataError
from posgpt.data.prepare import resolve_sources

from helpers import TINY, cli_error

VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """No network and an empty cache; returns the cache directory."""

    def no_network(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    cache = tmp_path / "cache"
    monkeypatch.setenv("POSGPT_CACHE", str(cache))
    return cache


def _default_run(tmp_path: Path, *extra: str) -> list[str]:
    """train.py's own defaults (no --data.input), shrunk to two steps."""
    return [*TINY, "--train.max_steps", "2", "--train.eval_interval", "2", "--train.logger", "none",
            "--data.prepared_root", str(tmp_path / "prepared"), "--train.out_dir", str(tmp_path / "runs"),
            *extra]  # fmt: skip


def test_the_default_run_offline_trains_on_pythons_docs_and_says_so_once(tmp_path, offline, caplog):
    with caplog.at_level(logging.INFO):
        cli.run(train_script.COMMAND, _default_run(tmp_path))
    run_dir = tmp_path / "runs" / f"python-docs-{VERSION}-char-rope"
    assert (run_dir / "last.ckpt").is_file()
    text = (offline / f"python-docs-{VERSION}.txt").read_text()
    assert len(text) > 300_000 and "assert" in text  # pydoc's topics, e.g. the assert statement
    notes = [r.getMessage() for r in caplog.records if "Python's bundled documentation" in r.getMessage()]
    assert len(notes) == 1
    assert "Could not download Tiny Shakespeare" in notes[0] and "data.input option" in notes[0]


def test_an_explicit_shakespeare_offline_still_stops_with_the_fix(tmp_path, offline, capsys):
    message = cli_error(capsys, train_script.COMMAND, _default_run(tmp_path, "--data.input", "shakespeare"))
    assert "Could not download Tiny Shakespeare" in message
    assert "--data.input /path/to/tinyshakespeare.txt" in message
    assert not (tmp_path / "runs").exists()


def test_auto_is_tiny_shakespeare_where_it_is_cached(offline, shakespeare_path, caplog):
    offline.mkdir()
    (offline / "tinyshakespeare.txt").write_bytes(shakespeare_path.read_bytes())
    with caplog.at_level(logging.INFO):
        assert [s.path for s in resolve_sources("auto")] == [(offline / "tinyshakespeare.txt").resolve()]
    assert not caplog.records  # nothing to say


def test_without_pydoc_data_the_standard_librarys_source_stands_in(offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # importing it now raises ImportError
    (path,) = (s.path for s in resolve_sources("python-docs"))
    assert path.name == f"python-stdlib-{VERSION}.txt"
    text = path.read_text()
    assert len(text) == corpora.STDLIB_SOURCE_CHARS and "import " in text


def test_an_unwritable_cache_is_one_clear_message(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("POSGPT_CACHE", str(blocker / "cache"))
    with pytest.raises(DataError, match="set POSGPT_CACHE to a writable directory"):
        resolve_sources("python-docs")
