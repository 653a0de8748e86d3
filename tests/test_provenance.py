"""`data.dataset`: what a checkpoint records of its training data, finding that data again, and
refusing data that changed since (on plain values, as a checkpoint records them)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import evaluate as evaluate_script
import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import CheckpointError
from posgpt.data.dataset import checkpoint_tokenizer, prepare_dir, recorded_data
from posgpt.data.errors import DataError
from posgpt.data.tokenizer import RANKS_ENV
from posgpt.evaluation.checkpoint import load_checkpoint

from helpers import tiny_args


def _data_config(text_file: Path, prepared_root: Path) -> dict:
    """A run's resolved data settings, as a checkpoint records them."""
    return {"input": str(text_file), "dir": None, "prepared_root": str(prepared_root), "tokenizer": "char",
            "val_fraction": 0.1, "errors": "strict", "glob": "*.txt"}  # fmt: skip


def test_the_recorded_prepared_directory_is_found_again(tmp_path, text_file):
    config = _data_config(text_file, tmp_path / "prepared")
    prepared = prepare_dir(str(text_file), None, config["prepared_root"])
    record = prepared.record()
    assert record["sources"] == [str(text_file.resolve())] and record["fingerprint"]
    found = recorded_data("x.ckpt", record, config, prepared.meta["tokenizer"])
    assert found.path == prepared.path.resolve()


def test_a_gone_split_is_prepared_again_only_from_unchanged_sources(tmp_path, text_file):
    config = _data_config(text_file, tmp_path / "prepared")
    prepared = prepare_dir(str(text_file), None, config["prepared_root"])
    record = prepared.record()
    shutil.rmtree(prepared.path)
    again = recorded_data("x.ckpt", record, config, prepared.meta["tokenizer"])
    assert again.meta["fingerprint"] == record["fingerprint"]
    shutil.rmtree(again.path)
    text_file.write_text("\t" + text_file.read_text())
    with pytest.raises(DataError, match=r"x\.ckpt was trained on other data than there is now: .* changed or moved"):
        recorded_data("x.ckpt", record, config, prepared.meta["tokenizer"])


def test_a_checkpoint_from_before_records_needs_the_same_vocabulary(tmp_path, text_file):
    config = _data_config(text_file, tmp_path / "prepared")
    meta = prepare_dir(str(text_file), None, config["prepared_root"]).meta["tokenizer"]
    assert recorded_data("old.ckpt", None, config, meta).meta["tokenizer"] == meta
    other = {**meta, "chars": meta["chars"][:-1]}
    with pytest.raises(DataError, match="now has another vocabulary"):
        recorded_data("old.ckpt", None, config, other)


def test_a_task_checkpoint_has_no_text_split(tmp_path, text_file):
    config = _data_config(text_file, tmp_path / "prepared")
    with pytest.raises(DataError, match="synthetic task 'copy', which has no text split"):
        recorded_data("task.ckpt", {"task": {"name": "copy"}}, config, {})


def test_evaluation_rebuilds_a_deleted_split_from_unchanged_sources(tmp_path, text_file):
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.logger", "none", "--train.max_steps", "6",
                                "--train.ckpt_interval", "3"))  # fmt: skip
    trained = tmp_path / "runs" / "tiny"
    ckpt = load_checkpoint(trained / "last.ckpt")
    prepared = Path(ckpt.data["prepared"])
    for file in prepared.iterdir():
        file.unlink()
    out = tmp_path / "out"
    args = ["--ckpt", str(trained / "last.ckpt"), "--eval.lengths", "[16]", "--eval.token_budget", "32"]
    cli.run(evaluate_script.COMMAND, [*args, "--eval.progress", "false", "--out", str(out)])
    assert json.loads((out / "results.json").read_text())["runs"][0]["results"][0]["ppl"] > 1
    assert json.loads((prepared / "meta.json").read_text())["fingerprint"] == ckpt.data["fingerprint"]


def test_the_ranks_file_passed_or_in_the_environment_wins_over_the_recorded_one(monkeypatch):
    def tried(given: str | None) -> str:  # the ranks file a checkpoint's GPT-2 tokenizer is rebuilt from
        with pytest.raises(CheckpointError, match="GPT-2 ranks file not found") as info:
            checkpoint_tokenizer({"kind": "gpt2"}, "/old/r50k", given, "x.ckpt")
        return re.search(r"not found: (\S+)", str(info.value)).group(1)

    monkeypatch.delenv(RANKS_ENV, raising=False)
    assert tried(None) == "/old/r50k"
    monkeypatch.setenv(RANKS_ENV, "/env/r50k")
    assert tried(None) == "/env/r50k"
    assert tried("/given/r50k") == "/given/r50k"
