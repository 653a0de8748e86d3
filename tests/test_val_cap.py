"""The validation cap (`val_max_tokens`): the split is the last min(val_fraction, cap) tokens; where the cap
does not bind, fingerprints and directory names are those the code gave before the cap existed (so old runs
resume and old checkpoints find their data), and where it binds the records carry it."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from posgpt.core.files import sha256_file
from posgpt.data import sources as sources_module
from posgpt.data.dataset import load_prepared, prepare_dir, recorded_data
from posgpt.data.prepare import VAL_MAX_TOKENS, fingerprint, prepare, resolve_sources, split_sizes
from posgpt.data.sources import Source
from posgpt.training.config import DataConfig

SETTINGS = {"tokenizer": "char", "val_fraction": 0.1, "errors": "strict"}


def old_fingerprint(paths: list[Path], settings: dict) -> str:
    """data/prepare.py's `fingerprint` before the cap and the other formats (commit bae9a5e), verbatim."""
    digest = hashlib.sha256(json.dumps({"format": 1, **settings}, sort_keys=True).encode())
    for path in paths:
        digest.update(str(path).encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


def old_directory(
    paths: list[Path], root: Path, tokenizer: str = "char", glob: str = "*.txt", val_fraction=0.1
) -> Path:
    """data/dataset.py's `prepare_dir` directory before the cap (commit bae9a5e), verbatim."""
    settings = [str(p) for p in paths] + [tokenizer, str(val_fraction), "strict", glob]
    key = hashlib.sha256("\n".join(settings).encode()).hexdigest()[:10]
    name = paths[0].stem if len(paths) == 1 else paths[0].parent.name
    return root / f"{name}-{tokenizer}-{key}"


def test_a_text_sources_fingerprint_is_the_one_of_before(monkeypatch):
    # computed with the code of commit bae9a5e, its sha256_file patched the same way
    monkeypatch.setattr(sources_module, "sha256_file", lambda path: "ab" * 32)
    key = fingerprint([Source("/corpus/a.txt", "text")], SETTINGS)
    assert key == "eb1965b5e1f958dad13857bbdd728aadca879f0bd10b7bf164ebe924d7b3cf37"


def test_where_the_cap_does_not_bind_names_and_fingerprints_are_unchanged(tmp_path, text_file):
    other = tmp_path / "other.txt"
    other.write_text("more text\n" * 50)
    root = tmp_path / "prepared"
    for paths, val_fraction in (([text_file], 0.1), ([text_file, other], 0.2)):
        paths = [p.resolve() for p in paths]
        data = prepare_dir([str(p) for p in paths], None, str(root), val_fraction=val_fraction)
        assert data.path == old_directory(paths, root, val_fraction=val_fraction)
        assert data.meta["fingerprint"] == old_fingerprint(paths, {**SETTINGS, "val_fraction": val_fraction})
        assert data.meta["val_capped"] is False and data.meta["val_max_tokens"] == VAL_MAX_TOKENS
        uncapped = prepare_dir([str(p) for p in paths], None, str(root), val_fraction=val_fraction, val_max_tokens=None)
        assert uncapped.meta["fingerprint"] == data.meta["fingerprint"]  # the same data, so the same fingerprint
        assert uncapped.path != data.path  # a setting other than the default names its own directory


def test_a_binding_cap_takes_the_last_tokens_and_joins_the_fingerprint(tmp_path, text_file, caplog):
    text = text_file.read_text()
    with caplog.at_level(logging.INFO):
        meta = prepare(str(text_file), str(tmp_path / "out"), "char", val_max_tokens=100)
    assert meta["val_tokens"] == 100 and meta["train_tokens"] == len(text) - 100 and meta["val_capped"] is True
    data = load_prepared(tmp_path / "out")
    assert data.tokenizer().decode(data.tokens("val").tolist()) == text[-100:]
    sources = resolve_sources(str(text_file))
    assert meta["fingerprint"] == fingerprint(sources, {**SETTINGS, "val_max_tokens": 100})
    assert meta["fingerprint"] != fingerprint(sources, SETTINGS)
    assert any("Validation split capped at 100 tokens" in r.getMessage() for r in caplog.records)


def test_split_sizes():
    assert split_sizes(1000, 0.1, None) == (900, 100, False)
    assert split_sizes(1000, 0.1, 100) == (900, 100, False)  # exactly the cap: it does not bind
    assert split_sizes(1000, 0.1, 30) == (970, 30, True)
    assert split_sizes(1000, 0.0, 30) == (1000, 0, False)
    assert split_sizes(10**10, 0.1, VAL_MAX_TOKENS) == (10**10 - 5_000_000, 5_000_000, True)


def test_reuse_follows_the_cap(tmp_path, text_file):
    out = tmp_path / "out"

    def run(cap: int | None) -> tuple[int, bool]:
        stamp = (out / "train.bin").stat().st_mtime_ns if out.exists() else None
        meta = prepare(str(text_file), str(out), "char", val_max_tokens=cap)
        return meta["val_tokens"], (out / "train.bin").stat().st_mtime_ns == stamp

    n_val = len(text_file.read_text()) - int(len(text_file.read_text()) * 0.9)
    assert run(100) == (100, False)
    assert run(100) == (100, True)  # reused
    assert run(200) == (200, False)  # another binding cap: another split
    assert run(None) == (n_val, False)
    assert run(10**9) == (n_val, True)  # a cap that does not bind: the same split, reused
    assert run(100) == (100, False)


def test_a_checkpoint_of_capped_data_finds_it_again(tmp_path, text_file):
    config = {"input": str(text_file), "dir": None, "prepared_root": str(tmp_path / "prepared"), "tokenizer": "char",
              "val_fraction": 0.1, "errors": "strict", "glob": "*.txt", "text_column": "text",
              "val_max_tokens": 100}  # fmt: skip
    data = prepare_dir(str(text_file), None, config["prepared_root"], val_max_tokens=100)
    record = data.record()
    assert record["val_capped"] is True and record["val_max_tokens"] == 100
    shutil.rmtree(data.path)
    again = recorded_data("x.ckpt", record, config, data.meta["tokenizer"])
    assert again.path == data.path and again.meta["fingerprint"] == record["fingerprint"]
    assert np.array_equal(again.tokens("val"), np.fromfile(again.path / "val.bin", again.dtype))


def test_a_checkpoint_from_before_the_cap_finds_its_directory_again(tmp_path, text_file):
    """A checkpoint's data settings without text_column and val_max_tokens, as checkpoints recorded them
    before: its split is prepared again under the name it had."""
    config = {"input": str(text_file), "dir": None, "prepared_root": str(tmp_path / "prepared"), "tokenizer": "char",
              "val_fraction": 0.1, "errors": "strict", "glob": "*.txt"}  # fmt: skip
    path = old_directory([text_file.resolve()], tmp_path / "prepared")
    data = prepare_dir(str(text_file), None, config["prepared_root"])
    record = {key: data.record()[key] for key in ("prepared", "fingerprint", "sources", "tokenizer",
                                                     "train_tokens", "val_tokens")}  # fmt: skip
    shutil.rmtree(data.path)
    again = recorded_data("old.ckpt", record, config, data.meta["tokenizer"])
    assert again.path == path and again.meta["fingerprint"] == old_fingerprint([text_file.resolve()], SETTINGS)


def test_the_run_configs_default_is_the_prepares_and_is_checked():
    assert DataConfig().val_max_tokens == VAL_MAX_TOKENS and DataConfig().text_column == "text"
    with pytest.raises(ValueError, match="data.val_max_tokens must be at least 1"):
        DataConfig(val_max_tokens=0)
    assert DataConfig(val_max_tokens=None).val_max_tokens is None
