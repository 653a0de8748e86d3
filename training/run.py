"""One training run, from a `RunConfig` to checkpoints: the logic behind `train.py`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import lightning as L
import torch
import yaml

from data.datamodule import TokenDataModule
from data.dataset import PreparedData, load_prepared
from data.errors import DataError
from data.prepare import prepare, resolve_sources
from data.tokenizer import Tokenizer
from training.callbacks import AtomicCheckpointIO, LastCheckpoint, SpeedMonitor
from training.checkpoint import check_same_model
from training.config import DataConfig, RunConfig
from training.hardware import check_strategy, resolve_precision
from training.module import GPTModule

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    last_ckpt: Path
    best_ckpt: Path | None
    best_val_loss: float | None
    sample: str | None


def prepared_data(cfg: DataConfig) -> PreparedData:
    """The prepared directory `cfg` names, preparing (or reusing) one under `prepared_root`."""
    if cfg.dir:
        return load_prepared(cfg.dir)
    if not cfg.input:
        raise DataError("No data: pass --data.input FILE|DIR|auto|shakespeare|python-docs or --data.dir PREPARED_DIR.")
    sources = resolve_sources(cfg.input, cfg.glob)
    settings = [str(p) for p in sources] + [cfg.tokenizer, str(cfg.val_fraction), cfg.errors, cfg.glob]
    key = hashlib.sha256("\n".join(settings).encode()).hexdigest()[:10]
    name = sources[0].stem if len(sources) == 1 else sources[0].parent.name
    out = Path(cfg.prepared_root) / f"{name}-{cfg.tokenizer}-{key}"
    prepare(
        [str(p) for p in sources], str(out), cfg.tokenizer, cfg.glob, cfg.val_fraction, cfg.errors, cfg.tiktoken_ranks
    )
    return load_prepared(out)


def padded_vocab(tokenizer: Tokenizer) -> int:
    """Embedding rows: a small vocabulary as is, a large one rounded up to a multiple of 64
    (GPT-2's 50257 -> 50304, nanoGPT's trick for faster matmuls; the extra rows are never targets)."""
    n = tokenizer.vocab_size
    return n if n <= 256 else -(-n // 64) * 64


def run_dir_of(cfg: RunConfig, data: PreparedData) -> Path:
    name = cfg.train.run_name
    if not name:
        source = Path(data.meta["sources"][0]).stem if data.meta.get("sources") else data.path.name
        name = f"{source}-{data.meta['tokenizer']['kind']}-{cfg.model.pos_encoding}"
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
        raise DataError(f"--train.resume {resume}: no such checkpoint. Pass an existing .ckpt file or 'auto'.")
    return path


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


def git_sha() -> str:
    try:
        repo = Path(__file__).resolve().parents[1]
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def train(cfg: RunConfig) -> RunResult:
    """Prepare data, build model and Trainer, fit, and sample a little text at the end."""
    t = cfg.train
    check_strategy(t.strategy, t.accelerator)
    precision = resolve_precision(t.precision, t.accelerator)
    L.seed_everything(t.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    data = prepared_data(cfg.data)
    tokenizer = data.tokenizer(cfg.data.tiktoken_ranks)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=padded_vocab(tokenizer)))
    config_dict = dataclasses.asdict(cfg)
    run_dir = run_dir_of(cfg, data)
    ckpt_path = resume_path(cfg.train.resume, run_dir)
    if ckpt_path is not None:
        check_same_model(ckpt_path, cfg.model)
    datamodule = TokenDataModule(
        data, cfg.model.block_size, cfg.train.batch_size, cfg.train.seed, cfg.train.eval_tokens
    )
    module = GPTModule(config_dict, tokenizer.meta())
    if cfg.train.compile:
        module.model.compile()  # in place: state_dict keys keep their names

    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        num_nodes=t.num_nodes,
        precision=precision,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.grad_accum,
        val_check_interval=t.eval_interval * t.grad_accum,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_interval,
        logger=make_logger(cfg, run_dir, config_dict),
        callbacks=[
            LastCheckpoint(run_dir, t.ckpt_interval),
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=run_dir, filename="best", monitor="val/loss", mode="min", enable_version_counter=False
            ),
        ],
        plugins=[AtomicCheckpointIO()],
        enable_progress_bar=t.progress_bar,
        default_root_dir=str(run_dir),
    )
    speed = SpeedMonitor(module.model.flops_per_token(cfg.model.block_size), t.log_interval)
    trainer.callbacks.append(speed)
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_dict, sort_keys=False))
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
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)

    best = trainer.checkpoint_callback
    best_path = Path(best.best_model_path) if best and best.best_model_path else None
    best_loss = float(best.best_model_score) if best and best.best_model_score is not None else None
    sample = None
    if trainer.is_global_zero and t.sample_tokens > 0:
        sample = sample_text(module, tokenizer, t.sample_tokens)
    return RunResult(run_dir, run_dir / "last.ckpt", best_path, best_loss, sample)


def sample_text(module: GPTModule, tokenizer: Tokenizer, n_tokens: int) -> str:
    """A short sample from the trained model, from the tokenizer's start token."""
    model = module.model.eval()
    start = tokenizer.start_ids()
    idx = torch.tensor([start], dtype=torch.long, device=module.device)
    # eagerly, even for a compiled model: each new cache length would otherwise be a new compilation
    with torch.compiler.set_stance("force_eager"):
        out = model.generate(idx, n_tokens, temperature=0.8, top_k=200)
    ids = [i for i in out[0, len(start) :].tolist() if i < tokenizer.vocab_size]  # padding rows are no tokens
    return tokenizer.decode(ids)


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
