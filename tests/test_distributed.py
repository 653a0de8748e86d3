"""Training on several CPU processes: FSDP2 (`--train.strategy fsdp2`) and DDP follow one process at the ranks' total
batch, FSDP2 shards every parameter, survives a killed rank with one message and resumes bit for bit; what cannot be
sharded is refused before any process starts; Lightning reads a launcher's ranks."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import model_parallel
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities import rank_zero_only
from split_batches import split_windows

import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.evaluation.checkpoint import gpt_from_checkpoint
from posgpt.evaluation.sampling import COMMAND as SAMPLE
from posgpt.training import datamodule
from posgpt.training.config import OptimConfig, RunConfig
from posgpt.training.distributed import ShardedStrategy, WatchedRanks, strategy_for
from posgpt.training.logs import metrics_file
from posgpt.training.module import GPTModule, adamw

from helpers import TINY, cli_error

SCRIPT = Path(__file__).with_name("split_batches.py")
FLOAT32 = ["--train.precision", "32-true", "--train.log_interval", "1", "--train.eval_interval", "4",
           "--train.ckpt_interval", "4", "--optim.decay_steps", "8", "--train.accelerator", "cpu"]  # fmt: skip


def args(tmp_path: Path, text_file: Path, out: str, *extra: str) -> list[str]:
    """A tiny float32 run into <tmp_path>/<out>/tiny, its data prepared once under tmp_path."""
    return [*TINY, *FLOAT32, "--data.input", str(text_file), "--data.prepared_root", str(tmp_path / "prepared"),
            "--train.out_dir", str(tmp_path / out), "--train.run_name", "tiny", *extra]  # fmt: skip


def one_process(tmp_path: Path, text_file: Path, out: str, monkeypatch, *extra: str) -> Path:
    """A run in this process at twice the batch, on the batches that two ranks share; its run directory."""
    monkeypatch.setattr(datamodule, "random_windows", split_windows)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cli.run(train_script.COMMAND, args(tmp_path, text_file, out, "--train.batch_size", "16", *extra))
    return tmp_path / out / "tiny"


def two_processes(tmp_path: Path, text_file: Path, out: str, *extra: str, wait: bool = True):
    """`train.py` on two CPU processes (Lightning starts the second) through split_batches.py."""
    argv = [sys.executable, str(SCRIPT), *args(tmp_path, text_file, out, "--train.devices", "2", *extra)]
    with open(tmp_path / f"{out}.log", "w") as log:  # the process has its own copy of the descriptor
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True)
    if wait:
        assert proc.wait(timeout=300) == 0, (tmp_path / f"{out}.log").read_text()[-3000:]
    return proc


def logged(run_dir: Path, metric: str) -> list[float]:
    with open(metrics_file(run_dir)) as f:
        return [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)]


def started_rank(proc: subprocess.Popen) -> int:
    """The PID of the rank that rank 0 (`proc`) started: the one child running split_batches.py."""
    ranks = []
    for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        with contextlib.suppress(OSError):
            if SCRIPT.name in Path(f"/proc/{pid}/cmdline").read_text():
                ranks.append(int(pid))
    assert len(ranks) == 1, ranks
    return ranks[0]


def moments_by_name(ckpt: dict) -> dict[str, torch.Tensor]:
    """AdamW's first moments of a checkpoint, loaded as a one-process run loads them, by parameter name."""
    model = gpt_from_checkpoint(ckpt, "ckpt")
    optimizer = adamw(model, OptimConfig(), torch.device("cpu"))
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    return {name: optimizer.state[p]["exp_avg"] for name, p in model.named_parameters()}


@pytest.mark.slow
def test_fsdp2_on_two_processes_shards_follows_one_process_stops_at_a_killed_rank_and_resumes_exactly(
    tmp_path, text_file, monkeypatch, capsys
):
    """One run, killed: its 8 first steps follow one process at twice the batch (loss and clipped gradient norm),
    each rank holds half of every parameter, the blocks are compiled one by one; kill -9 of rank 1 ends rank 0
    within --train.rank_timeout with one line, the last checkpoint intact. Resumed from step 4 on two processes, it
    ends at step 8 bit for bit and samples; its checkpoint samples in one process, its AdamW moments load there."""
    reference = one_process(tmp_path, text_file, "one", monkeypatch, "--train.max_steps", "8")
    run = tmp_path / "sharded" / "tiny"
    proc = two_processes(tmp_path, text_file, "sharded", "--train.strategy", "fsdp2", "--train.max_steps", "1000",
                         "--train.keep_every", "4", "--train.compile", "true", "--train.rank_timeout", "20",
                         wait=False)  # fmt: skip
    started = time.monotonic()
    while not (run / "step-0000008.ckpt").is_file() and proc.poll() is None and time.monotonic() - started < 240:
        time.sleep(0.1)
    assert proc.poll() is None, (tmp_path / "sharded.log").read_text()[-3000:]
    os.kill(started_rank(proc), signal.SIGKILL)
    killed = time.monotonic()
    code = proc.wait(timeout=60)
    log = (tmp_path / "sharded.log").read_text()
    assert code == 2 and time.monotonic() - killed < 20, log[-3000:]
    assert log.strip().splitlines()[-1].startswith("error: rank 1 (PID ") and "killed by signal 9" in log
    assert f"the last complete checkpoint, {run / 'last.ckpt'}, is intact" in log and "Traceback" not in log
    assert read_checkpoint(run / "last.ckpt")["global_step"] % 4 == 0

    for rank in (0, 1):  # FSDP2's DTensors, each rank holding its half of every parameter's rows
        shards = json.loads((run / f"shards-{rank}.json").read_text())
        assert shards["compiled"] == ["FSDPBlock"] * 2  # each block, sharded, on its own; the model not
        for name, p in shards["params"].items():
            assert p["type"] == "DTensor" and p["placements"] == ["S(0)"], name
            assert p["local"][1:] == p["shape"][1:] and p["local"][0] == (p["shape"][0] + 1 - rank) // 2, name
    for metric in ("train/loss", "train/grad_norm"):  # the loss: the mean over ranks; the norm: over every shard
        assert logged(run, metric)[:8] == pytest.approx(logged(reference, metric), abs=1e-5), metric
    assert max(logged(reference, "train/grad_norm")) > 1.0  # clipped (optim.grad_clip 1.0) on some step

    resumed = tmp_path / "resumed" / "tiny"
    two_processes(tmp_path, text_file, "resumed", "--train.strategy", "fsdp2", "--train.max_steps", "8",
                  "--train.compile", "true", "--train.resume", str(run / "step-0000004.ckpt"),
                  "--train.sample_tokens", "5")  # fmt: skip
    a, b = (read_checkpoint(path) for path in (run / "step-0000008.ckpt", resumed / "last.ckpt"))
    for name, tensor in a["state_dict"].items():
        assert torch.equal(b["state_dict"][name], tensor), name
    for i, state in a["optimizer_states"][0]["state"].items():
        assert all(torch.equal(b["optimizer_states"][0]["state"][i][k], v) for k, v in state.items()), i
    assert "--- sample ---" in (tmp_path / "resumed.log").read_text()  # rank 0's, from the whole model

    cli.run(SAMPLE, ["--ckpt", str(run / "step-0000008.ckpt"), "--max_new_tokens", "5", "--prompt", "The "])
    assert "5 tokens in" in capsys.readouterr().err  # 5 new characters after "The "
    sharded, one = (moments_by_name(ckpt) for ckpt in (a, read_checkpoint(reference / "last.ckpt")))
    for name, expected in one.items():  # each parameter's, as a one-process run loads them
        torch.testing.assert_close(sharded[name], expected, rtol=1e-3, atol=1e-8, msg=name)


@pytest.mark.slow
def test_ddp_on_two_processes_follows_one_process_and_switches(tmp_path, text_file, monkeypatch):
    """DDP's 8 steps, the mean loss over ranks, follow one process at twice the batch; DroPE switches under DDP."""
    switch = ["--train.max_steps", "8", "--train.switch_at", "4",
              "--train.switch_model", "{pos_encoding: none, attn_log_scaling: fixed}"]  # fmt: skip
    reference = one_process(tmp_path, text_file, "one", monkeypatch, *switch)
    two_processes(tmp_path, text_file, "ddp", "--train.strategy", "ddp", *switch)
    run = tmp_path / "ddp" / "tiny"
    assert logged(run, "train/loss") == pytest.approx(logged(reference, "train/loss"), abs=1e-5)
    assert len(logged(run, "train/loss")) == 8
    ckpt = read_checkpoint(run / "last.ckpt")
    assert ckpt["global_step"] == 8
    assert ckpt["switched_at"] == 4 and ckpt["model_config"]["pos_encoding"] == "none"


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (["--train.strategy", "fsdp_cpu_offload"], "posgpt shards with FSDP2, not Lightning's FSDP1"),
        (["--train.precision", "16-mixed"], "not --train.precision 16-mixed"),
        (["--train.switch_at", "4", "--train.switch_model", "{pos_encoding: none}"], "cannot switch the model"),
    ],
)
def test_what_cannot_be_sharded_is_refused_before_any_process_starts(tmp_path, text_file, capsys, option, needle):
    argv = args(tmp_path, text_file, "runs", "--train.strategy", "fsdp2", "--train.devices", "2", *option)
    assert needle in cli_error(capsys, train_script.COMMAND, argv)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "launcher",
    [
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "TORCHELASTIC_RUN_ID": "posgpt",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        },  # torchrun
        {
            "SLURM_NTASKS": "4",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NAME": "train",
            "SLURM_JOB_ID": "7",
            "SLURM_NODELIST": "node[1-2]",
        },
    ],  # fmt: skip
    ids=["torchrun", "slurm"],
)
def test_fsdp2_takes_the_ranks_and_world_size_a_launcher_sets(monkeypatch, launcher):
    """Two nodes of two processes: the process a launcher started as global rank 3 (the second of node 1) is that
    rank, and every rank is on FSDP2's data-parallel axis, without starting a process."""
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # the Trainer sets it: undone after
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy_for("fsdp2", 60),
                        logger=False, enable_checkpointing=False)  # fmt: skip
    strategy = trainer.strategy
    assert isinstance(strategy, ShardedStrategy) and strategy.cluster_environment.creates_processes_externally
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (3, 1, 1, 4)
    meshes = []
    monkeypatch.setattr(model_parallel, "_setup_device_mesh", lambda *sizes: meshes.append(sizes[:3]))
    monkeypatch.setattr(strategy, "_setup_distributed", lambda: None)  # no process group
    strategy._lightning_module = SimpleNamespace()
    strategy.setup_environment()
    assert meshes == [(4, 1, 4)]  # (data parallel, tensor parallel, world size): every rank shards


def test_a_resume_under_fsdp2_edits_the_optimizer_the_strategy_has_loaded():
    """FSDP2 loads the optimizer's state before `on_load_checkpoint` (Lightning's restore order for this strategy):
    the current optim settings are then written into the optimizer itself."""
    assert not strategy_for("fsdp2", 60).lightning_restore_optimizer
    config = RunConfig()
    optim = dataclasses.replace(config.optim, lr=2e-3, beta2=0.95, weight_decay=0.05)
    module = GPTModule(dataclasses.replace(config, optim=optim), {}, {})
    optimizer = torch.optim.AdamW(
        [{"params": [torch.zeros(2, 2)], "weight_decay": 0.1}, {"params": [torch.zeros(2)], "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
    )
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(lightning_restore_optimizer=False),
                                      optimizers=[optimizer])  # fmt: skip
    module.on_load_checkpoint({"optimizer_states": [optimizer.state_dict()]})
    decay, other = optimizer.param_groups
    assert decay["betas"] == (0.9, 0.95) and decay["weight_decay"] == 0.05 and other["weight_decay"] == 0.0
    assert decay["initial_lr"] == 2e-3 and decay["lr"] == pytest.approx(2e-3 / 101)  # warm-up's first step


def test_a_rank_that_ends_while_this_one_hangs_is_named_and_the_node_ended(monkeypatch, capsys):
    """Where rank 0 does not stop by itself within --train.rank_timeout after a rank it started ended (a collective
    that hangs), the watch names that rank and ends the node's processes."""
    launcher = WatchedRanks(_SubprocessScriptLauncher(LightningEnvironment(), 2, 1), 0.1)
    launcher.procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])]
    launcher.procs[0].wait()
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: killed.append((pid, signum)))
    launcher._watch()  # returns where the process would have been ended
    assert killed == [(os.getpid(), signal.SIGKILL)] and launcher.procs[0].returncode == 3
    assert capsys.readouterr().err == (
        f"error: rank 1 (PID {launcher.procs[0].pid}) ended, exit status 3, and this rank did not stop within "
        "--train.rank_timeout 0.1 s: the node's ranks are ended. Continue with the same command and --train.resume "
        "auto.\n"
    )
