"""One training run, from a `RunConfig` to checkpoints: the logic behind `train.py`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import lightning as L
import torch
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_only

from core.errors import UserError
from core.files import LockedError, atomic_write_bytes, directory_lock, remove_stale_tmp
from core.repo import git_sha
from data.datamodule import TaskDataModule, TokenDataModule
from data.dataset import PreparedData, prepare_dir
from data.provenance import provenance
from data.tasks import TaskConfig
from data.tokenizer import Tokenizer
from model import GPT
from model.kernels import AUTO
from training.callbacks import AtomicCheckpointIO, DivergenceGuard, LastCheckpoint, SpeedMonitor
from training.checkpoint import check_resume
from training.config import DataConfig, RunConfig, TrainConfig
from training.fp8 import check_fp8, convert_to_fp8
from training.hardware import check_accelerator, check_strategy, resolve_precision
from training.module import GPTModule

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    last_ckpt: Path
    best_ckpt: Path | None
    best_val_loss: float | None
    sample: str | None


class RunError(UserError, ValueError):
    """A problem with the run directory or the run's options; the message says how to fix it."""


def prepared_data(cfg: DataConfig) -> PreparedData:
    """The prepared directory `cfg` names, preparing (or reusing) one under `prepared_root`."""
    return prepare_dir(
        cfg.input,
        cfg.dir,
        cfg.prepared_root,
        cfg.tokenizer,
        cfg.glob,
        cfg.val_fraction,
        cfg.errors,
        cfg.tiktoken_ranks,
        text_column=cfg.text_column,
        val_max_tokens=cfg.val_max_tokens,
    )


@dataclass
class TrainingData:
    """What a run trains on: batches, their tokenizer, the record of the data that checkpoints keep
    (to resume only on the same data, and to evaluate on it later), and a name for run directories."""

    datamodule: L.LightningDataModule
    tokenizer: Tokenizer
    record: dict[str, Any]
    name: str


def corpus_data(cfg: RunConfig) -> TrainingData:
    """A prepared corpus (`cfg.data`): random training windows, fixed validation windows."""
    data = prepared_data(cfg.data)
    t = cfg.train
    budget = t.validation_tokens(cfg.model.block_size)
    datamodule = TokenDataModule(data, cfg.model.block_size, t.batch_size, t.seed, budget)  # checks the splits
    v = datamodule.validation_record()
    log.info("Validation: %d windows of %d tokens = %d of the split's %d tokens (--train.eval_tokens %s)",
             v["windows"], cfg.model.block_size, v["tokens"], v["split_tokens"],
             "0: the whole split" if budget == 0 else budget)  # fmt: skip
    source = data.meta.get("name") or (
        Path(data.meta["sources"][0]).stem if data.meta.get("sources") else data.path.name
    )
    name = f"{source}-{data.meta['tokenizer']['kind']}"
    return TrainingData(datamodule, data.tokenizer(cfg.data.tiktoken_ranks), provenance(data), name)


def task_data(task: TaskConfig, cfg: RunConfig) -> TrainingData:
    """A synthetic task (`data.tasks`): its own vocabulary, loss on the answers only."""
    datamodule = TaskDataModule(task, cfg.train.batch_size, cfg.train.seed)
    record = {"task": dataclasses.asdict(task), "fingerprint": task.fingerprint(), "prepared": f"task {task.name}"}
    return TrainingData(datamodule, datamodule.tokenizer, record, f"task-{task.name}")


def run_dir_of(cfg: RunConfig, data: TrainingData) -> Path:
    name = cfg.train.run_name or f"{data.name}-{cfg.model.pos_encoding}"
    return Path(cfg.train.out_dir) / name


def resume_path(resume: str | None, run_dir: Path) -> Path | None:
    """'auto' -> <run_dir>/last.ckpt if present; a path -> that path (which must exist)."""
    if not resume:
        return None
    if resume == "auto":
        last = run_dir / "last.ckpt"
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise RunError(f"--train.resume {resume}: no such checkpoint. Pass an existing .ckpt file or 'auto'.")
    return path


CHECKPOINT_NAMES = ("last.ckpt", "best.ckpt")


def claim_run_dir(run_dir: Path, resume: Path | None, overwrite: bool) -> None:
    """Refuse to start a fresh run in a directory that holds checkpoints (unless `overwrite`, which
    removes them first), and remove what killed writers left there. Call it holding the lock."""
    existing = [run_dir / name for name in CHECKPOINT_NAMES if (run_dir / name).is_file()]
    if existing and resume is None:
        if not overwrite:
            raise RunError(
                f"{run_dir} already holds {', '.join(p.name for p in existing)} from an earlier run. Resume it "
                "with --train.resume auto, or pass --train.overwrite true (deletes them) or another --train.run_name."
            )
        for path in existing:
            path.unlink()
        log.info("--train.overwrite: removed %s", ", ".join(str(p) for p in existing))
    for path in remove_stale_tmp(run_dir):
        log.info("Removed %s, left by a run that was killed while writing it", path)


def check_writable(path: Path, option: str) -> None:
    """Stop, before any work is done, when `path` cannot be created or written (a file is in the
    way, or a parent is read-only); creates nothing."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RunError(f"Cannot create {path}: {existing} is a file. Pass {option} DIR, a directory.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunError(f"Cannot write to {path}: {existing} is read-only. Pass {option} DIR that you can write.")


def make_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunError(
            f"Cannot create the run directory {run_dir} ({error.strerror or error}). Pass --train.out_dir DIR "
            "that you can write, or another --train.run_name."
        ) from None


def make_logger(cfg: RunConfig, run_dir: Path, config_dict: dict[str, Any]):
    kind = cfg.train.logger
    if kind == "none":
        return False
    if kind == "csv":
        # one version_N directory per launch: a resumed run adds a version instead of overwriting
        return L.pytorch.loggers.CSVLogger(save_dir=str(run_dir), name="logs")
    from lightning.pytorch.loggers import WandbLogger

    online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline" and _wandb_reachable()
    if not online:
        log.info("wandb: no API key or no network; logging offline to %s/wandb (upload later: wandb sync)", run_dir)
    return WandbLogger(
        project=cfg.train.wandb_project,
        name=run_dir.name,
        save_dir=str(run_dir),
        offline=not online,
        config=config_dict,
    )


def _wandb_reachable(timeout: float = 3.0) -> bool:
    """Whether the wandb server answers a TCP connection (checked only when an API key is set)."""
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def train(cfg: RunConfig, data: TrainingData | None = None) -> RunResult:
    """Prepare data (`cfg.data`, unless `data` is given: a task), build model and Trainer, fit, and
    sample a little text at the end. The clock of `train.max_minutes` starts here."""
    t = cfg.train
    deadline = time.monotonic() + 60 * t.max_minutes if t.max_minutes else None
    check_accelerator(t.accelerator)
    check_strategy(t.strategy, t.accelerator)
    precision = resolve_precision(t.precision, t.accelerator)
    if t.fp8:
        check_fp8(t.accelerator, precision)
    check_writable(Path(t.out_dir), "--train.out_dir")
    L.seed_everything(t.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    data = data or corpus_data(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data.tokenizer.vocab_size))
    run_dir = run_dir_of(cfg, data)
    make_run_dir(run_dir)
    if not rank_zero_only.rank == 0:  # DDP/FSDP workers: rank 0 holds the directory and has checked it
        return _fit(cfg, data, run_dir, precision, resume_path(t.resume, run_dir), deadline)
    try:
        with directory_lock(run_dir):
            ckpt_path = resume_path(t.resume, run_dir)
            claim_run_dir(run_dir, ckpt_path, t.overwrite)
            return _fit(cfg, data, run_dir, precision, ckpt_path, deadline)
    except LockedError as error:
        raise RunError(
            f"{error}: another run is training into it. Wait for it, or pass another --train.run_name."
        ) from None


def _fit(
    cfg: RunConfig, data: TrainingData, run_dir: Path, precision: str, ckpt_path: Path | None, deadline: float | None
) -> RunResult:
    t = cfg.train
    if ckpt_path is not None:
        for change in check_resume(ckpt_path, cfg, data.record):
            log.info("Resuming with %s", change)
    module = GPTModule(cfg, data.tokenizer.meta(), data.record)
    module.model.activation_checkpointing = t.activation_checkpointing
    if t.fp8:
        log.info("FP8 training: %d linear layers through torchao's float8", convert_to_fp8(module.model))
    if t.compile:
        module.model.compile(mode=t.compile_mode)  # in place: state_dict keys keep their names

    last = LastCheckpoint(run_dir, t.ckpt_interval, t.eval_interval, deadline)
    trainer = _trainer(
        t,
        precision=precision,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.grad_accum,
        val_check_interval=t.eval_interval * t.grad_accum,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_interval,
        logger=make_logger(cfg, run_dir, dataclasses.asdict(cfg)),
        callbacks=[
            DivergenceGuard(last, t.log_interval, t.ckpt_interval, t.eval_interval),
            last,
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=run_dir, filename="best", monitor="val/loss", mode="min", enable_version_counter=False
            ),
            SpeedMonitor(module.model.flops_per_token(cfg.model.block_size), t.log_interval),
        ],
        plugins=[AtomicCheckpointIO()],
        enable_progress_bar=t.progress_bar,
        default_root_dir=str(run_dir),
    )
    note = dropout_fallback(module.model, trainer.strategy.root_device)
    if note and trainer.is_global_zero:
        log.info(note)
    if trainer.is_global_zero:
        config_yaml = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False).encode()
        atomic_write_bytes(run_dir / "config.yaml", config_yaml)
        log.info(
            "git %s, torch %s, %s, %d parameters, run dir %s%s",
            git_sha(),
            torch.__version__,
            trainer.precision,  # as Lightning runs it (it turns 16-mixed on a CPU into bf16-mixed)
            module.model.num_params(),
            run_dir,
            f", resuming from {ckpt_path}" if ckpt_path else "",
        )
    with warnings.catch_warnings():
        # config.yaml (and, on resume, the checkpoints) are meant to be in the run directory
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
        trainer.fit(module, datamodule=data.datamodule, ckpt_path=ckpt_path)

    best = trainer.checkpoint_callback
    best_path = Path(best.best_model_path) if best and best.best_model_path else None
    best_loss = float(best.best_model_score) if best and best.best_model_score is not None else None
    sample = None
    if trainer.is_global_zero and t.sample_tokens > 0:
        sample = sample_text(module, data.tokenizer, t.sample_tokens)
    return RunResult(run_dir, run_dir / "last.ckpt", best_path, best_loss, sample)


def dropout_fallback(model: GPT, device: torch.device) -> str | None:
    """One line when attention dropout moves training off its fused kernel on `device`
    (FlexAttention has no dropout: a bias or a window then runs through SDPA with a float mask
    formed in memory), else None."""
    c = model.config
    if c.dropout == 0 or c.attn_backend != AUTO:  # a named kernel is what runs, or a refusal at the forward
        return None
    names = [model.attention.kernel_name(model.kernel(device, dropout, needs_grad=True)) for dropout in (True, False)]
    if names[0] == names[1]:
        return None
    with_dropout, without = names
    what = f"pos_encoding={c.pos_encoding}" + (f", attn_window={c.attn_window}" if c.attn_window else "")
    return (
        f"model.dropout {c.dropout}: attention with {what} runs on {with_dropout} with a float mask, not {without} "
        "(which has no attention dropout); slower and more memory at long contexts. --model.dropout 0 keeps "
        f"{without}."
    )


def _trainer(t: TrainConfig, **kwargs: Any) -> L.Trainer:
    """A Trainer on the hardware `t` names; what Lightning refuses there (an unknown strategy, a device
    list that does not exist, a missing accelerator package) becomes one message."""
    try:
        return L.Trainer(
            accelerator=t.accelerator, devices=t.devices, strategy=t.strategy, num_nodes=t.num_nodes, **kwargs
        )
    except (ValueError, TypeError, ImportError, MisconfigurationException) as error:
        raise RunError(
            f"Lightning cannot run --train.accelerator {t.accelerator} --train.devices {t.devices} "
            f"--train.strategy {t.strategy} here: {error}"
        ) from None


def sample_text(module: GPTModule, tokenizer: Tokenizer, n_tokens: int) -> str:
    """A short sample from the trained model, from the tokenizer's start token."""
    model = module.model.eval()
    start = tokenizer.start_ids()
    idx = torch.tensor([start], dtype=torch.long, device=module.device)
    # eagerly, even for a compiled model: each new cache length would otherwise be a new compilation
    with torch.compiler.set_stance("force_eager"):
        out = model.generate(idx, n_tokens, temperature=0.8, top_k=200)
    return tokenizer.decode(out[0, len(start) :].tolist())


def latest_metrics(run_dir: Path) -> Path:
    """metrics.csv of the latest launch of a run logged with the csv logger (logs/version_N)."""
    versions = (run_dir / "logs").glob("version_*")
    return max(versions, key=lambda p: int(p.name.split("_")[1])) / "metrics.csv"


def result_summary(result: RunResult) -> str:
    return json.dumps(
        {
            "run_dir": str(result.run_dir),
            "last_ckpt": str(result.last_ckpt),
            "best_ckpt": str(result.best_ckpt) if result.best_ckpt else None,
            "best_val_loss": result.best_val_loss,
        }
    )
