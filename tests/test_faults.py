"""Hostile input and faults: each case ends in one clear message and a non-zero exit, with nothing
silently wrong, half-written or destroyed (issue 10's battery; tiny models, generated text)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_text

import evaluate as evaluate_script
import sample as sample_script
import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import CheckpointError, read_checkpoint
from posgpt.core.files import directory_lock
from posgpt.data.dataset import prepare_dir
from posgpt.data.tokenizer import RANKS_ENV
from posgpt.evaluation.checkpoint import load_checkpoint
from posgpt.training.config import OptimConfig, TrainConfig, lr_factor

from helpers import cli_error, exits_with, signal_during, tiny_args

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, text_file: Path, *extra: str) -> Path:
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.logger", "none", *extra))
    return tmp_path / "runs" / "tiny"


@pytest.fixture
def trained(tmp_path, text_file) -> Path:
    """A tiny run of 6 steps with a checkpoint every 3, for a test that changes it."""
    return _run(tmp_path, text_file, "--train.max_steps", "6", "--train.ckpt_interval", "3")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The same run, trained once per module and worker for the tests that only read it (a refused resume writes
    nothing): its root, its text and its run directory."""
    root = tmp_path_factory.mktemp("shared-run")
    text = root / "corpus.txt"
    text.write_text(make_text(), encoding="utf-8")
    torch.manual_seed(0)
    return root, text, _run(root, text, "--train.max_steps", "6", "--train.ckpt_interval", "3")


# 1. data provenance


def test_evaluation_refuses_a_changed_corpus(tmp_path, text_file, trained, capsys, caplog):
    ckpt = str(trained / "last.ckpt")
    args = ["--ckpt", ckpt, "--eval.lengths", "[16]", "--eval.token_budget", "32", "--eval.progress", "false"]
    record = load_checkpoint(ckpt).data
    assert record["fingerprint"] and record["sources"] == [str(text_file.resolve())]  # recorded at training time
    cli.run(evaluate_script.COMMAND, [*args, "--out", str(tmp_path / "ok")])
    reference = json.loads((tmp_path / "ok" / "results.json").read_text())["runs"][0]["results"][0]["loss"]
    later = time.time() + 60
    os.utime(text_file, (later, later))  # touched (copied, checked out) but the same text: no warning
    cli.run(evaluate_script.COMMAND, [*args, "--out", str(tmp_path / "touched")])
    assert "changed since training" not in caplog.text
    text_file.write_text("\t" + text_file.read_text())  # one character more, and a new one
    # the split prepared for training is still there: it is used, and the changed source is named
    cli.run(evaluate_script.COMMAND, [*args, "--out", str(tmp_path / "kept")])
    kept = json.loads((tmp_path / "kept" / "results.json").read_text())["runs"][0]["results"][0]["loss"]
    assert kept == reference and "changed since training" in caplog.text
    # re-prepared from the changed text (e.g. by another run): refused, nothing written
    prepare_dir(str(text_file), None, str(tmp_path / "prepared"))
    message = cli_error(capsys, evaluate_script.COMMAND, [*args, "--out", str(tmp_path / "changed")])
    assert "trained on other data" in message and "--eval_data.input" in message
    assert not (tmp_path / "changed").exists()


def test_resume_refuses_other_data_another_seed_and_another_model_shape(tmp_path, shared, capsys):
    root, text_file, trained = shared
    before = (trained / "last.ckpt").read_bytes()
    other = tmp_path / "other.txt"
    other.write_text(make_text(400, seed=3))
    message = cli_error(capsys, train_script.COMMAND, tiny_args(root, other, "--train.max_steps", "8",
                                                             "--train.resume", "auto"))  # fmt: skip
    assert "Cannot resume" in message and "data: checkpoint trained on" in message
    argv = tiny_args(root, text_file, "--train.max_steps", "8", "--train.resume", "auto", "--train.seed", "7")
    message = cli_error(capsys, train_script.COMMAND, argv)
    assert "train.seed: checkpoint 1337 vs now 7" in message
    argv = tiny_args(root, text_file, "--train.max_steps", "8", "--model.n_layer", "3", "--train.resume", "auto")
    message = cli_error(capsys, train_script.COMMAND, argv)
    assert "Cannot resume" in message and "model.n_layer: checkpoint 2 vs now 3" in message
    assert (trained / "last.ckpt").read_bytes() == before
    into = ["--train.resume", str(trained / "last.ckpt"), "--train.run_name", "new"]  # issue 57: left .lock in it
    assert "Cannot resume" in cli_error(capsys, train_script.COMMAND, [*argv[:-2], *into])
    assert not (root / "runs" / "new").exists()


# 2. NaN and inf


def test_a_diverging_run_keeps_the_last_good_checkpoint_and_a_second_run_there_stops(
    tmp_path, text_file, trained, capsys
):
    good = read_checkpoint(trained / "last.ckpt")
    assert (trained / "best.ckpt").is_file()
    argv = tiny_args(tmp_path, text_file, "--train.logger", "none", "--train.max_steps", "40",
                     "--train.ckpt_interval", "3", "--train.resume", "auto", "--optim.lr", "1e6")  # fmt: skip
    err = cli_error(capsys, train_script.COMMAND, argv)  # no checkpoint of the diverged model
    assert err.startswith("error: Training diverged") and "--optim.lr" in err
    assert f"{trained / 'last.ckpt'} (step 6)" in err or "from before this launch" in err
    after = read_checkpoint(trained / "last.ckpt")
    assert after["global_step"] == good["global_step"] == 6  # not overwritten with a diverged model
    assert all(torch.isfinite(t).all() for t in after["state_dict"].values())
    best = read_checkpoint(trained / "best.ckpt")  # from the good run's final evaluation, kept
    assert best["global_step"] == 6 and all(torch.isfinite(t).all() for t in best["state_dict"].values())

    # 4. run directories: a second run (no --train.resume) into the directory stops, until --train.overwrite true
    message = cli_error(capsys, train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.max_steps", "4"))
    assert "already holds" in message and "--train.resume auto" in message and "--train.overwrite true" in message
    assert torch.equal(read_checkpoint(trained / "last.ckpt")["state_dict"]["model.wte.weight"],
                       good["state_dict"]["model.wte.weight"])  # fmt: skip
    _run(tmp_path, text_file, "--train.max_steps", "4", "--train.overwrite", "true")
    assert read_checkpoint(trained / "last.ckpt")["global_step"] == 4


def test_a_fresh_diverging_run_writes_no_checkpoint(tmp_path, text_file, capsys):
    argv = tiny_args(tmp_path, text_file, "--train.logger", "none", "--train.max_steps", "30", "--optim.lr", "1e6",
                     "--optim.warmup_steps", "0")  # fmt: skip
    assert "no checkpoint was written" in cli_error(capsys, train_script.COMMAND, argv)
    assert not (tmp_path / "runs" / "tiny" / "last.ckpt").exists()
    assert not (tmp_path / "runs" / "tiny" / "best.ckpt").exists()


def _nan(state: dict) -> None:
    state[next(k for k in state if k.endswith("mlp.fc.weight"))][0, 0] = float("nan")


def _wider(state: dict) -> None:
    state["model.wte.weight"] = torch.cat([state["model.wte.weight"], state["model.wte.weight"][:1]])


@pytest.mark.parametrize(
    ("spoil", "needle"),
    [
        (_nan, "non-finite weights"),
        (_wider, "do not fit its own recorded config (wte.weight is ("),  # (V + 1, 32) in the file, (V, 32) ...
        (lambda state: state.pop("model.ln_f.weight"), "config (missing ln_f.weight): "),
    ],
    ids=["nan", "a-wider-tensor", "a-missing-tensor"],
)
def test_sampling_and_evaluating_a_spoiled_checkpoint_is_one_message(tmp_path, shared, capsys, spoil, needle):
    """Non-finite weights, and weights that do not fit the checkpoint's own config: one line naming the
    first tensor that does not fit, not PyTorch's size-mismatch dump of every one."""
    ckpt = torch.load(shared[2] / "last.ckpt", weights_only=False)
    spoil(ckpt["state_dict"])
    bad = tmp_path / "spoiled.ckpt"
    torch.save(ckpt, bad)
    for command, argv in (
        (sample_script.COMMAND, ["--ckpt", str(bad), "--max_new_tokens", "5"]),
        (evaluate_script.COMMAND, ["--ckpt", str(bad), "--eval.lengths", "[16]", "--out", str(tmp_path / "e")]),
    ):
        assert needle in cli_error(capsys, command, argv)


# 3. signals


@pytest.mark.slow
def test_a_sigterm_saves_a_checkpoint_and_exits_143_and_resume_is_exact(tmp_path, text_file):
    """A real process, a real signal from outside."""
    signum = signal.SIGTERM
    common = ["--train.logger", "none", "--optim.decay_steps", "200", "--train.ckpt_interval", "5"]
    killed = tmp_path / "killed"
    argv = tiny_args(killed, text_file, *common, "--train.max_steps", "100000", "--train.progress_bar", "true")
    threads = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # this process's: the same sums
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=tmp_path, env=threads,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (killed / "runs" / "tiny" / "last.ckpt").exists():
        time.sleep(0.05)  # the first periodic checkpoint: training is under way
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert "Stopped by SIGTERM" in err and "--train.resume auto" in err
    assert "Traceback" not in err
    stopped = read_checkpoint(killed / "runs" / "tiny" / "last.ckpt")
    step = stopped["global_step"]
    assert step > 5  # saved at the signal, after the first periodic checkpoint
    end = str(step + 3)
    argv = tiny_args(killed, text_file, *common, "--train.max_steps", end, "--train.resume", "auto")
    cli.run(train_script.COMMAND, argv)
    straight = tmp_path / "straight"
    cli.run(train_script.COMMAND, tiny_args(straight, text_file, *common, "--train.max_steps", end))
    a = read_checkpoint(killed / "runs" / "tiny" / "last.ckpt")["state_dict"]
    b = read_checkpoint(straight / "runs" / "tiny" / "last.ckpt")["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, text_file, monkeypatch, capsys):
    signal_during(monkeypatch, "training_step", "tiny", step=4, signum=signal.SIGINT)
    err = exits_with(capsys, train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.logger", "none"), 130)
    assert err.strip().splitlines()[-1].startswith("Stopped by SIGINT at step 5; saved")
    assert read_checkpoint(tmp_path / "runs" / "tiny" / "last.ckpt")["global_step"] == 5


# 4. run directories


def test_a_run_directory_in_use_is_refused(tmp_path, text_file, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    with directory_lock(run_dir):
        message = cli_error(capsys, train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.max_steps", "2"))
    assert "in use by another process" in message and "--train.run_name" in message


# 5. resume with new settings


def test_resume_applies_a_new_learning_rate_schedule_says_so_and_removes_temporary_files(
    tmp_path, text_file, trained, caplog
):
    """The new settings are logged, and the jump of the rate (the checkpoint's cosine ended at step 6, at
    min_lr) in one line; the temporary checkpoint a killed run left is removed."""
    stale = trained / ".last.ckpt.tmp999999"
    stale.write_bytes(b"partial")
    with caplog.at_level("INFO", logger="posgpt.training.run"):
        _run(tmp_path, text_file, "--train.max_steps", "8", "--train.resume", "auto", "--optim.lr", "1e-3",
             "--optim.min_lr", "1e-5", "--optim.beta2", "0.9")  # fmt: skip
    assert not stale.exists()
    assert "Resuming with train.max_steps: 6 -> 8" in caplog.text
    assert "Resuming with the learning rate at step 6: 0.0001 -> 0.000753 at once" in caplog.text
    ckpt = read_checkpoint(trained / "last.ckpt")
    assert ckpt["lr_schedulers"][0]["base_lrs"] == [1e-3, 1e-3]
    decay, no_decay = ckpt["optimizer_states"][0]["param_groups"]
    expected = 1e-3 * lr_factor(8, 1e-3, 1e-5, 5, 8)  # tiny runs warm up for 5 steps; decay ends at max_steps
    assert decay["lr"] == pytest.approx(expected) and no_decay["lr"] == pytest.approx(expected)
    assert decay["betas"] == (0.9, 0.9) and decay["initial_lr"] == 1e-3
    assert ckpt["hyper_parameters"]["config"]["optim"]["lr"] == 1e-3


# 6. truncated checkpoints


def test_every_truncation_of_a_checkpoint_is_one_message(tmp_path, text_file, shared, capsys):
    data = (shared[2] / "last.ckpt").read_bytes()
    cuts = sorted(
        {1, 10, 100, 1000, len(data) // 2, len(data) - 100, len(data) - 1} | {len(data) * i // 40 for i in range(1, 40)}
    )
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.ckpt"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="not a readable checkpoint"):
            load_checkpoint(bad)
        bad.unlink()
    bad = tmp_path / "cut.ckpt"
    bad.write_bytes(data[: len(data) // 3])
    for command, argv in (
        (sample_script.COMMAND, ["--ckpt", str(bad), "--max_new_tokens", "5"]),
        (evaluate_script.COMMAND, ["--ckpt", str(bad), "--eval.lengths", "[16]", "--out", str(tmp_path / "e")]),
        (train_script.COMMAND, tiny_args(tmp_path, text_file, "--train.max_steps", "8", "--train.resume", str(bad))),
    ):
        assert "not a readable checkpoint" in cli_error(capsys, command, argv)


# 7. the GPT-2 ranks file


def test_a_bpe_checkpoint_whose_ranks_file_moved(tmp_path, text_file, gpt2_ranks, monkeypatch, capsys):
    monkeypatch.delenv(RANKS_ENV, raising=False)
    moved = tmp_path / "r50k_base.tiktoken"
    moved.write_bytes(gpt2_ranks.read_bytes())
    _run(tmp_path, text_file, "--data.tokenizer", "gpt2", "--data.tiktoken_ranks", str(moved), "--train.max_steps", "2",
         "--model.n_embd", "16", "--model.n_head", "2")  # fmt: skip
    ckpt = str(tmp_path / "runs" / "tiny" / "last.ckpt")
    moved.unlink()
    message = cli_error(capsys, sample_script.COMMAND, ["--ckpt", ckpt, "--max_new_tokens", "3"])
    assert "ranks file not found" in message and "--tiktoken_ranks" in message and RANKS_ENV in message
    monkeypatch.setenv(RANKS_ENV, str(gpt2_ranks))
    cli.run(sample_script.COMMAND, ["--ckpt", ckpt, "--max_new_tokens", "3"])
    assert "3 tokens" in capsys.readouterr().err


# 8. range checks


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--train.batch_size", "0"], "train.batch_size must be at least 1"),
        (["--train.batch_size", "-2"], "train.batch_size must be at least 1"),
        (["--train.max_steps", "0"], "train.max_steps must be at least 1"),
        (["--train.max_steps", "-1"], "train.max_steps must be at least 1"),
        (["--optim.lr", "0"], "optim.lr must be positive"),
        (["--optim.lr=-1e-3"], "optim.lr must be positive"),
        (["--train.ckpt_interval", "0"], "train.ckpt_interval must be at least 1"),
        (["--train.eval_interval", "0"], "train.eval_interval must be at least 1"),
        (["--train.log_interval", "0"], "train.log_interval must be at least 1"),
        (["--train.grad_accum", "0"], "train.grad_accum must be at least 1"),
        (["--train.precision", "bf17"], "train.precision 'bf17' is not one of"),
        (["--train.accelerator", "gpu"] if not torch.cuda.is_available() else ["--train.devices", "0"], "train"),
    ],
)
def test_run_settings_out_of_range_are_one_message(tmp_path, text_file, capsys, args, needle):
    message = cli_error(capsys, train_script.COMMAND, tiny_args(tmp_path, text_file, *args))
    assert needle in message
    assert not (tmp_path / "runs").exists() and not (tmp_path / "prepared").exists()


def test_a_setting_left_unset_is_refused_unless_its_type_allows_none():
    """A study's variant builds its settings with `dataclasses.replace`, past the parser's types: a None where a
    number is needed is refused at once, not deep inside training; the settings that may be unset stay so."""
    with pytest.raises(ValueError, match="train.batch_size must be at least 1, got None"):
        TrainConfig(batch_size=None)
    with pytest.raises(ValueError, match="optim.grad_clip must be at least 0, got None"):
        OptimConfig(grad_clip=None)
    assert TrainConfig(eval_tokens=None).eval_tokens is None and OptimConfig(decay_steps=None).decay_steps is None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max_new_tokens", "-5"], "--max_new_tokens must be at least 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top_p", "0"], "--top_p must be in (0, 1]"),
        (["--top_k", "-3"], "--top_k must be at least 0"),
        (["--num_samples", "0"], "--num_samples must be at least 1"),
        (["--max_context", "-4"], "--max_context must be at least 1"),
        (["--device", "tpu"], "--device tpu"),
    ],
)
def test_sample_settings_out_of_range_are_one_message(tmp_path, capsys, args, needle):
    assert needle in cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(tmp_path / "any.ckpt"), *args])


# 9. the file system


def test_file_system_mistakes_are_one_message(tmp_path, text_file, shared, capsys):
    trained = shared[2]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (tiny_args(tmp_path, text_file, "--train.out_dir", str(a_file)), "is a file"),
        (tiny_args(tmp_path, text_file, "--data.prepared_root", str(a_file / "sub")), "Cannot write prepared data"),
        (tiny_args(tmp_path, text_file, "--data.dir", str(a_file)), "not a prepared dataset directory"),
    ]
    prepared = Path(load_checkpoint(trained / "last.ckpt").data["prepared"])
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for file in prepared.glob("*.bin"):
        (corrupt / file.name).write_bytes(file.read_bytes())
    (corrupt / "meta.json").write_text("{not json")
    cases.append((tiny_args(tmp_path, text_file, "--data.dir", str(corrupt)), "meta.json is unreadable or corrupt"))
    for argv, needle in cases:
        assert needle in cli_error(capsys, train_script.COMMAND, argv)
    started = time.perf_counter()
    message = cli_error(capsys, evaluate_script.COMMAND, ["--ckpt", str(trained / "last.ckpt"), "--out", str(a_file)])
    assert "--out" in message and "is a file" in message and time.perf_counter() - started < 5


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, text_file, trained, capsys, monkeypatch):
    """ENOSPC, and what torch.save into a file object on a full disk raises instead: a RuntimeError from its zip
    writer. Each ends in one line naming the disk, the intact previous checkpoint and the resume."""
    import posgpt.training.callbacks as callbacks

    before = (trained / "last.ckpt").read_bytes()

    def no_space(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(trained / ".last.ckpt.tmp"))

    def zip_writer_fails(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 5184 vs 5078")

    argv = tiny_args(tmp_path, text_file, "--train.logger", "none", "--train.max_steps", "9", "--train.ckpt_interval",
                     "3", "--train.resume", "auto")  # fmt: skip
    monkeypatch.setattr(callbacks.torch, "save", no_space)
    message = cli_error(capsys, train_script.COMMAND, argv)
    assert "no space left" in message and "--train.resume auto" in message
    assert (trained / "last.ckpt").read_bytes() == before
    assert not [p for p in trained.iterdir() if ".tmp" in p.name]

    monkeypatch.setattr(callbacks.torch, "save", zip_writer_fails)
    message = cli_error(capsys, train_script.COMMAND, argv)
    assert message.startswith(f"error: Could not write {trained / 'last.ckpt'}: ")
    assert f"the previous {trained / 'last.ckpt'} is intact" in message and "disk mounted at /" in message
    assert "--train.resume auto" in message and "Traceback" not in capsys.readouterr().err
    assert (trained / "last.ckpt").read_bytes() == before
    assert read_checkpoint(trained / "last.ckpt")["global_step"] == 6
    assert not [p for p in trained.iterdir() if ".tmp" in p.name]
