"""sample.py end to end on a checkpoint from a tiny training run, and its error messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sample as sample_script
import train as train_script
from core import cli

from helpers import cli_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from conftest import make_text

    tmp = tmp_path_factory.mktemp("sample")
    text = tmp / "corpus.txt"
    text.write_text(make_text())
    cli.run(train_script.COMMAND, [
        "--model.n_layer", "2", "--model.n_head", "4", "--model.n_embd", "32", "--model.block_size", "32",
        "--train.batch_size", "8", "--train.max_steps", "30", "--train.eval_interval", "30",
        "--train.progress_bar", "false", "--train.sample_tokens", "0", "--train.logger", "none",
        "--optim.lr", "3e-3", "--optim.warmup_steps", "5",
        "--data.input", str(text), "--data.prepared_root", str(tmp / "prepared"),
        "--train.out_dir", str(tmp / "runs"), "--train.run_name", "tiny",
    ])  # fmt: skip
    return tmp / "runs" / "tiny" / "last.ckpt"


def _sample(capsys, *args: str) -> str:
    cli.run(sample_script.COMMAND, list(args))
    return capsys.readouterr().out


def test_same_seed_same_sample_and_the_prompt_is_continued(checkpoint, capsys):
    args = ["--ckpt", str(checkpoint), "--prompt", "The king", "--max_new_tokens", "40", "--seed", "5"]
    first, second = _sample(capsys, *args), _sample(capsys, *args)
    assert first == second and first.startswith("The king") and len(first.rstrip("\n")) == len("The king") + 40
    assert _sample(capsys, *args[:-1], "6") != first


def test_cache_and_no_cache_give_the_same_text(checkpoint, capsys):
    args = ["--ckpt", str(checkpoint), "--prompt", "A fool", "--max_new_tokens", "80", "--temperature", "0"]
    assert _sample(capsys, *args) == _sample(capsys, *args, "--no_cache", "true")


def test_several_samples_and_prompt_from_a_file(checkpoint, capsys, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("My lord")
    out = _sample(capsys, "--ckpt", str(checkpoint), "--prompt", f"@{prompt}", "--num_samples", "3",
                  "--max_new_tokens", "20")  # fmt: skip
    samples = out.split("\n---------------\n")
    assert len(samples) == 3 and all(s.startswith("My lord") for s in samples)


def test_empty_prompt_starts_from_a_newline(checkpoint, capsys):
    out = _sample(capsys, "--ckpt", str(checkpoint), "--max_new_tokens", "20")
    assert out.startswith("\n") and len(out) >= 20


def test_command_line_streams_text_and_reports_speed(checkpoint):
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(checkpoint), "--prompt", "The queen",
         "--max_new_tokens", "30", "--stream", "true"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The queen") and "tokens/s" not in result.stdout
    assert "tokens/s" in result.stderr


def test_characters_outside_the_vocabulary_are_named_or_dropped(checkpoint, capsys):
    message = cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(checkpoint), "--prompt", "The kïng€",
                                                        "--max_new_tokens", "5"])  # fmt: skip
    assert "'ï€'" in message and "--drop_unknown" in message
    out = _sample(
        capsys, "--ckpt", str(checkpoint), "--prompt", "The kïng", "--drop_unknown", "true", "--max_new_tokens", "5"
    )
    assert out.startswith("The kng")


def test_missing_or_corrupt_checkpoint_fails_with_one_message(tmp_path, capsys):
    assert "Checkpoint not found" in cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(tmp_path / "nope.ckpt")])
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    assert "not a readable checkpoint" in cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(corrupt)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_one_clear_message(checkpoint, capsys):
    argv = ["--ckpt", str(checkpoint), "--device", "cuda", "--max_new_tokens", "2"]
    assert "CUDA is not available here" in cli_error(capsys, sample_script.COMMAND, argv)


def test_bfloat16_weights_on_cpu_sample_as_a_gpu_run_would(checkpoint, capsys):
    """`--dtype auto` is bfloat16 on a GPU: the same cast weights, run here on the CPU."""
    args = ["--ckpt", str(checkpoint), "--prompt", "The king", "--max_new_tokens", "30", "--device", "cpu"]
    cli.run(sample_script.COMMAND, [*args, "--dtype", "bfloat16", "--temperature", "0"])
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("The king") and len(out.rstrip("\n")) == len("The king") + 30
    assert "cpu, torch.bfloat16" in captured.err
    uncached = _sample(capsys, *args, "--dtype", "bfloat16", "--temperature", "0", "--no_cache", "true")
    assert uncached == out  # the KV cache holds bf16 keys and values, as the uncached path computes them
