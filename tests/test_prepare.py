"""data.prepare: token files, tokenizers, splits, reuse, atomicity, and errors a user can cause."""

from __future__ import annotations

import builtins
import errno
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import make_text

from posgpt.core import files as files_module
from posgpt.core.files import LockedError, directory_lock
from posgpt.data import prepare as prepare_module
from posgpt.data.dataset import load_prepared
from posgpt.data.errors import DataError
from posgpt.data.prepare import prepare, resolve_sources, token_dtype
from posgpt.data.tokenizer import EOT, CharTokenizer, GPT2Tokenizer

from helpers import cli_error

ROOT = Path(__file__).resolve().parents[1]


def _all_tokens(out: Path) -> np.ndarray:
    data = load_prepared(out)
    return np.concatenate([data.tokens("train"), data.tokens("val")])


def test_char_round_trip_split_and_meta(text_file, tmp_path):
    text = text_file.read_text()
    meta = prepare(str(text_file), str(tmp_path / "out"), "char", val_fraction=0.1)
    assert meta["dtype"] == "uint16"
    assert meta["train_tokens"] == int(len(text) * 0.9) and meta["train_tokens"] + meta["val_tokens"] == len(text)
    assert meta["tokenizer"]["vocab_size"] == len(set(text)) and meta["format_version"] == 1
    data = load_prepared(tmp_path / "out")
    assert data.tokenizer().decode(_all_tokens(tmp_path / "out").tolist()) == text
    # the split is the end of the corpus: val decodes to the text's last characters
    assert data.tokenizer().decode(data.tokens("val").tolist()) == text[meta["train_tokens"] :]


def test_gpt2_round_trip_offline_with_the_shared_ranks(text_file, tmp_path, gpt2_ranks, monkeypatch):
    monkeypatch.setenv("POSGPT_TIKTOKEN_RANKS", str(gpt2_ranks))  # the environment-variable route
    text = text_file.read_text()
    meta = prepare(str(text_file), str(tmp_path / "out"), "gpt2", workers=2)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == {"kind": "gpt2", "vocab_size": 50257}
    tok = GPT2Tokenizer(gpt2_ranks)  # the option route
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids
    assert tok.decode(_all_tokens(tmp_path / "out").tolist()) == text + EOT  # <|endoftext|> ends each file


def test_gpt2_without_ranks_offline_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.delenv("POSGPT_TIKTOKEN_RANKS", raising=False)
    with pytest.raises(DataError, match="not found"):
        GPT2Tokenizer(tmp_path / "missing.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not a ranks file\n")
    with pytest.raises(DataError, match="r50k_base"):
        GPT2Tokenizer(bad)


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(65) == np.uint16 and token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(100277) == np.uint32


def test_directory_input_is_recursive_sorted_and_globbed(tmp_path):
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_text("first\n")
    (root / "b" / "c.txt").write_text("second\n")
    (root / "notes.md").write_text("ignored\n")
    prepare(str(root), str(tmp_path / "out"), "char", val_fraction=0.0)
    data = load_prepared(tmp_path / "out")
    assert data.tokenizer().decode(data.tokens("train").tolist()) == "first\nsecond\n"
    prepare([str(root / "notes.md"), str(root / "a.txt")], str(tmp_path / "out2"), "char", val_fraction=0.0)
    data = load_prepared(tmp_path / "out2")
    assert data.tokenizer().decode(data.tokens("train").tolist()) == "ignored\nfirst\n"


def test_unchanged_sources_are_reused_and_changed_ones_redone(text_file, tmp_path):
    out = tmp_path / "out"
    prepare(str(text_file), str(out), "char")
    stamp = (out / "train.bin").stat().st_mtime_ns
    prepare(str(text_file), str(out), "char")
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    text_file.write_text(make_text(seed=1))
    meta = prepare(str(text_file), str(out), "char")
    assert json.loads((out / "meta.json").read_text())["fingerprint"] == meta["fingerprint"]
    assert load_prepared(out).tokenizer().decode(_all_tokens(out).tolist()) == make_text(seed=1)


def test_an_interrupted_prepare_leaves_nothing_trusted(text_file, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare(str(text_file), str(out), "char")
    text_file.write_text(make_text(seed=2))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "split_sizes", crash)  # every token written, none split off yet
    with pytest.raises(KeyboardInterrupt):
        prepare(str(text_file), str(out), "char")
    assert not (out / "meta.json").exists() and not list(out.glob("*.tmp"))
    with pytest.raises(DataError, match="no meta.json"):
        load_prepared(out)
    monkeypatch.undo()
    prepare(str(text_file), str(out), "char")
    assert load_prepared(out).tokenizer().decode(_all_tokens(out).tolist()) == make_text(seed=2)


@pytest.mark.parametrize(
    ("content", "setup", "needle"),
    [
        (None, "missing", "Input not found"),
        (b"", "file", "no text"),
        (None, "empty_dir", "no files matching"),
        (b"GIF89a\x00\x01\x02binary", "file", "binary"),
        (b"caf\xe9 au lait\n", "file", "not valid UTF-8"),
    ],
    ids=["missing", "empty", "no-matching-files", "binary", "latin-1"],
)
def test_bad_inputs_fail_with_one_clear_message_and_write_nothing(tmp_path, content, setup, needle):
    source = tmp_path / "input.txt"
    if setup == "file":
        source.write_bytes(content)
    elif setup == "empty_dir":
        source = tmp_path / "dir"
        source.mkdir()
        (source / "readme.md").write_text("not a txt file")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=needle):
        prepare(str(source), str(out), "char")
    assert not (out / "meta.json").exists() and not list(tmp_path.rglob("*.tmp"))


def test_invalid_utf8_can_be_replaced_explicitly(tmp_path):
    source = tmp_path / "latin1.txt"
    source.write_bytes(b"caf\xe9 au lait\n" * 20)
    prepare(str(source), str(tmp_path / "out"), "char", errors="replace")
    assert "\ufffd" in load_prepared(tmp_path / "out").tokenizer().decode(_all_tokens(tmp_path / "out").tolist())


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer("abc")
    with pytest.raises(DataError, match="'xz'"):
        tok.encode("abxcz")


def test_named_corpus_comes_from_the_cache_without_network(tmp_path, monkeypatch, shakespeare_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tinyshakespeare.txt").write_bytes(shakespeare_path.read_bytes())
    monkeypatch.setenv("POSGPT_CACHE", str(cache))

    def no_network(*args, **kwargs):
        raise AssertionError("must not download when the cache holds the file")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    assert [s.path for s in resolve_sources("shakespeare")] == [(cache / "tinyshakespeare.txt").resolve()]


def test_named_corpus_offline_says_how_to_pass_a_local_file(tmp_path, monkeypatch):
    monkeypatch.setenv("POSGPT_CACHE", str(tmp_path / "empty-cache"))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match=r"offline\? Pass a local copy instead: --data.input"):
        resolve_sources("shakespeare")


# a full disk


class _FullDisk:
    """A file opened for writing on a disk that fills after `room` bytes: the write that passes it writes what
    fits, then raises ENOSPC."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.file.write(data[: self.room])
            raise OSError(errno.ENOSPC, "No space left on device", self.file.name)
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def _fill_disk(monkeypatch, module, room: int = 10, skip: int = 0) -> None:
    """`module`'s files opened for writing, after the first `skip`, see a disk that fills after `room` bytes."""
    real_open = builtins.open
    opened = []

    def full_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        if "w" not in mode and "+" not in mode:
            return file
        opened.append(path)
        return file if len(opened) <= skip else _FullDisk(file, room)

    monkeypatch.setattr(module, "open", full_open, raising=False)


# the three writes of a prepare: the token stream, the validation split, meta.json (module, writes before it)
WRITERS = {"tokens": (files_module, 0), "split": (files_module, 1), "meta": (files_module, 2)}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_full_disk_leaves_nothing_and_says_so_in_one_line(text_file, tmp_path, monkeypatch, capsys, writer):
    root = tmp_path / "prepared"  # neither it nor out exists yet: both are the prepare's to remove
    out = root / "corpus"
    _fill_disk(monkeypatch, *WRITERS[writer])
    line = cli_error(capsys, prepare_module.COMMAND, ["--inputs", str(text_file), "--out_dir", str(out)])
    assert "No space left on device" in line and "Free some space" in line and "discarded" in line
    assert not root.exists()  # no token file, no temporary file, no lock file, no directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def test_a_full_disk_in_a_directory_the_user_made_removes_only_what_the_prepare_wrote(text_file, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare(str(text_file), str(out), "char")  # a complete earlier prepare, then other text
    (out / "notes.txt").write_text("mine")
    text_file.write_text(make_text(seed=3))
    before = {p.name for p in out.iterdir()}
    _fill_disk(monkeypatch, files_module)
    with pytest.raises(DataError, match="No space left on device"):
        prepare(str(text_file), str(out), "char")
    left = {p.name for p in out.iterdir()}
    assert left <= before and "notes.txt" in left and (out / "notes.txt").read_text() == "mine"
    assert not {"meta.json", "train.bin", "val.bin"} & left and not [n for n in left if ".tmp" in n]
    monkeypatch.undo()
    prepare(str(text_file), str(out), "char")  # the next prepare (space freed) succeeds
    assert load_prepared(out).tokenizer().decode(_all_tokens(out).tolist()) == make_text(seed=3)


def test_a_waiter_on_a_lock_its_failed_holder_removed_locks_afresh(tmp_path):
    """A tidy holder that fails removes the lock file while a second writer waits on it: the waiter then
    holds the file at the path (a third writer would find it locked), not the removed one."""
    out = tmp_path / "new" / "out"
    holding, waiter_done, seen = threading.Event(), threading.Event(), {}

    def wait_for_it() -> None:
        holding.wait()
        with directory_lock(out, wait=True, tidy=True):
            lock = out / ".lock"
            seen["exists"] = lock.exists()
            try:
                with directory_lock(out):
                    seen["third"] = "got it"
            except files_module.LockedError:
                seen["third"] = "refused"
        waiter_done.set()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    with pytest.raises(RuntimeError), directory_lock(out, tidy=True):
        holding.set()
        threading.Event().wait(0.3)  # the waiter is blocked on the lock by now
        raise RuntimeError("failed")
    waiter.join(10)
    assert waiter_done.is_set() and seen == {"exists": True, "third": "refused"}
    assert (out / ".lock").exists()  # the waiter succeeded: its lock stays, as a lock always did


def test_concurrent_prepares_of_one_corpus_both_succeed_and_agree(tmp_path):
    """Two prepares of one directory started together: each waits while the lock is held (here by the test, so
    that they overlap however loaded the machine), then both finish, one after the other, with one complete
    output and no temporary file left."""
    corpus = tmp_path / "big.txt"
    corpus.write_text(make_text(30000))
    out = tmp_path / "prepared"
    cmd = [sys.executable, "-m", "posgpt", "prepare", "--inputs", str(corpus), "--out_dir", str(out)]
    with directory_lock(out):
        procs = [
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"
        ]
        waited = [next((line for line in p.stderr if "waiting for it to finish" in line), "") for p in procs]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert all(waited), (waited, results)
    assert sum("Reusing" in err for _, err in results) == 1, results  # the second found the first's output
    meta = json.loads((out / "meta.json").read_text())
    assert (out / "train.bin").stat().st_size == meta["train_tokens"] * np.dtype(meta["dtype"]).itemsize
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_a_directory_lock_keeps_a_second_holder_out(tmp_path):
    with directory_lock(tmp_path):
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
            with directory_lock(tmp_path):
                pass
    with directory_lock(tmp_path):  # released
        pass


def test_a_prepare_removes_what_a_killed_one_left(tmp_path, text_file):
    out = tmp_path / "prepared"
    out.mkdir()
    stale = out / "tokens.bin.tmp999999"
    stale.write_bytes(b"\0" * 100)
    prepare(str(text_file), str(out))
    assert not stale.exists()
