"""train.py end to end on CPU: checkpoints that rebuild model and tokenizer, falling val loss,
exact resume, DDP with two processes, and one clear message for each mistake a user can make."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.evaluation.checkpoint import load_checkpoint
from posgpt.training.config import lr_factor
from posgpt.training.logs import metrics_file

from helpers import cli_error, tiny_args

ROOT = Path(__file__).resolve().parents[1]


def val_losses(run_dir: Path) -> list[float]:
    """Validation losses that the latest launch logged (each launch writes logs/version_N)."""
    with open(metrics_file(run_dir)) as f:
        return [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]


def test_training_leaves_checkpoints_that_rebuild_model_and_tokenizer_and_ends_evaluated(tmp_path, text_file, capsys):
    """Validation runs every eval_interval steps and after the last step, also when max_steps is no
    multiple of the interval (Lightning alone would skip it): best.ckpt always exists."""
    cli.run(
        train_script.COMMAND,
        tiny_args(
            tmp_path, text_file, "--train.max_steps", "40", "--train.eval_interval", "15", "--train.sample_tokens", "50"
        ),
    )
    run_dir = tmp_path / "runs" / "tiny"
    assert {"last.ckpt", "best.ckpt", "config.yaml"} <= {p.name for p in run_dir.iterdir()}
    assert not list(run_dir.glob(".*tmp*"))  # no temporary checkpoint left behind
    losses = val_losses(run_dir)
    with open(metrics_file(run_dir)) as f:  # tokens counted from the batches: 8 windows of 32 a step
        rows = list(csv.DictReader(f))
    tokens = {int(r["step"]): float(r["train/tokens"]) for r in rows if r.get("train/tokens")}
    assert tokens and all(count == (step + 1) * 8 * 32 for step, count in tokens.items())
    assert [int(r["step"]) for r in rows if r.get("val/loss")] == [14, 29, 39]  # 0-based: steps 15, 30 and the 40th
    assert read_checkpoint(run_dir / "best.ckpt")["global_step"] in (15, 30, 40)
    vocab = len(set(text_file.read_text()))
    assert len(losses) == 3 and losses[-1] < losses[0] < math.log(vocab)  # val loss falls from ~ln(V)
    loaded = load_checkpoint(run_dir / "last.ckpt")
    assert loaded.step == 40 and loaded.model.config.pos_encoding == "rope"  # the default config's scheme
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("The king loves the sea.")) == "The king loves the sea."
    idx = torch.tensor([loaded.tokenizer.encode("The king ")])
    with torch.no_grad():
        logits, _ = loaded.model(idx)
    assert logits.shape == (1, idx.size(1), loaded.model.config.vocab_size)
    assert "--- sample ---" in capsys.readouterr().out


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True)


def _bad_input(kind: str, d: Path) -> Path:
    """A data source that is wrong in the way `kind` names."""
    contents = {
        "empty": b"",
        "binary": b"\x00\x01\x02" * 50,
        "not-utf8": b"caf\xe9\n" * 50,
        "shorter-than-a-window": b"too short\n" * 3,
    }
    if kind == "missing":
        return d / "missing.txt"
    if kind == "no-matching-files":
        (d / "sub").mkdir()
        (d / "sub" / "notes.md").write_text("not a .txt file")
        return d / "sub"
    path = d / f"{kind}.txt"
    path.write_bytes(contents[kind])
    return path


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("missing", "Input not found"),
        ("empty", "no text"),
        ("no-matching-files", "no files matching"),
        ("binary", "binary"),
        ("not-utf8", "--data.errors replace"),
        ("shorter-than-a-window", "shorter than one training window"),
    ],
)
def test_bad_data_fails_with_one_clear_message(tmp_path, kind, needle, capsys):
    argv = tiny_args(tmp_path, _bad_input(kind, tmp_path), "--train.max_steps", "2")
    assert needle in cli_error(capsys, train_script.COMMAND, argv)
    assert not (tmp_path / "runs").exists()  # nothing written for a run that never started
    assert not list(tmp_path.rglob("*.tmp*"))


def test_config_mistakes_fail_with_one_clear_message(tmp_path, text_file, capsys):
    with pytest.raises(SystemExit) as info:  # jsonargparse names the unknown option
        cli.run(train_script.COMMAND, [*tiny_args(tmp_path, text_file), "--model.n_layr", "3"])
    assert info.value.code == 2 and "n_layr" in capsys.readouterr().err
    message = cli_error(capsys, train_script.COMMAND, [*tiny_args(tmp_path, text_file), "--model.n_embd", "30"])
    assert "n_embd (30) must be divisible by n_head (4)" in message
    assert not (tmp_path / "runs").exists()


def test_help_and_print_config(capsys):
    with pytest.raises(SystemExit) as info:
        cli.run(train_script.COMMAND, ["--help"])
    help_text = capsys.readouterr().out
    assert info.value.code == 0
    for option in ("--model.pos_encoding", "--train.resume", "--data.tiktoken_ranks", "--optim.warmup_steps"):
        assert option in help_text
    assert "Optimizer steps of linear warm-up" in help_text  # field docstrings are the help text
    assert "--model.vocab_size" not in help_text  # the tokenizer's, set from the data
    with pytest.raises(SystemExit) as info:
        cli.run(train_script.COMMAND, ["--print_config", "--model.pos_encoding", "alibi"])
    config = capsys.readouterr().out
    assert info.value.code == 0 and "pos_encoding: alibi" in config and "n_layer: 4" in config


@pytest.mark.slow
def test_wandb_without_an_api_key_logs_offline_into_the_run_dir(tmp_path, text_file, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.max_steps", "4", "--train.logger", "wandb"))
    runs = list((tmp_path / "runs" / "tiny" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))
    record = tmp_path / "runs" / "tiny"  # the run's own record beside wandb's
    assert (record / "metrics.csv").is_file() and (record / "training.png").is_file()


def test_the_default_validation_of_a_large_corpus_is_bounded(tmp_path, caplog):
    """A 3 MB character corpus (315K validation characters) trains 3 steps with the default run's
    validation: 200 batches of 12 x 64, not the whole split (of a 22 MB corpus it took 7.5 minutes on two cores)."""
    import logging

    import numpy as np

    rng = np.random.default_rng(0)
    block = "".join(rng.choice(list("abcdefghij klmnopqrst\n"), size=1 << 20))
    corpus = tmp_path / "large.txt"
    corpus.write_text(block * 3)
    argv = ["--data.input", str(corpus), "--data.prepared_root", str(tmp_path / "prepared"),
            "--train.out_dir", str(tmp_path / "runs"), "--train.max_steps", "3", "--train.progress_bar", "false",
            "--train.sample_tokens", "0", "--train.logger", "none", "--model.n_layer", "1", "--model.n_head", "2",
            "--model.n_embd", "32"]  # fmt: skip  # the default run's batches, a small model to score them
    with caplog.at_level(logging.INFO):
        cli.run(train_script.COMMAND, argv)
    ckpt = read_checkpoint(next((tmp_path / "runs").glob("*/last.ckpt")))
    validation = ckpt["TokenDataModule"]["validation"]
    assert validation == {"windows": 2400, "tokens": 200 * 12 * 64, "split_tokens": 314573}
    assert "validation scores 153,600 of 314,573)" in caplog.text


def test_lr_factor_warms_up_decays_and_stays_at_min_lr():
    assert lr_factor(0, 1.0, 0.1, 10, 110) == pytest.approx(1 / 11)
    assert lr_factor(9, 1.0, 0.1, 10, 110) == pytest.approx(10 / 11)
    assert lr_factor(10, 1.0, 0.1, 10, 110) == pytest.approx(1.0)
    assert lr_factor(60, 1.0, 0.1, 10, 110) == pytest.approx(0.55)  # half way down the cosine
    assert lr_factor(110, 1.0, 0.1, 10, 110) == pytest.approx(0.1)
    assert lr_factor(500, 1.0, 0.1, 10, 110) == pytest.approx(0.1)


def test_a_kernel_the_device_cannot_run_is_refused_before_any_data_is_prepared(tmp_path, text_file, capsys):
    """The config's checks know no device; the run's preflight does, before the corpus (minutes for a large one)."""
    message = cli_error(capsys, train_script.COMMAND, tiny_args(tmp_path, text_file, "--model.attn_backend", "flex",
                                                                 "--train.accelerator", "cpu"))  # fmt: skip
    assert "attn_backend='flex' cannot run this configuration: it lacks a forward pass on cpu" in message
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "runs").exists()
