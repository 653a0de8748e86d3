"""One training run, from a `RunConfig` to checkpoints: the logic behind `train.py`."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_only

from posgpt.core.checkpoint import read_checkpoint
from posgpt.core.cli import quiet_libraries
from posgpt.core.errors import UserError
from posgpt.core.files import LockedError, directory_lock
from posgpt.core.repo import git_sha
from posgpt.data.corpora import AUTO as AUTO_CORPUS
from posgpt.data.dataset import PreparedData, prepare_dir
from posgpt.data.tasks import TaskConfig
from posgpt.data.tokenizer import GPT2Tokenizer, Tokenizer
from posgpt.evaluation.checkpoint import gpt_from_checkpoint, model_config_of, weights_misfit
from posgpt.model import GPT, SCHEMES, GPTConfig
from posgpt.model.config import model_tags
from posgpt.model.kernels import AUTO
from posgpt.model.pretrained import PretrainedError, check_pretrained, from_pretrained, names_checkpoint, weights_file
from posgpt.model.roles import Role
from posgpt.training.callbacks import AtomicCheckpointIO, LastCheckpoint, MetricsWriter, ProgressBar, ProgressLines
from posgpt.training.config import EVAL_BATCHES, SHARDED, DataConfig, RunConfig
from posgpt.training.curves import write_training_plot
from posgpt.training.datamodule import TaskDataModule, TokenDataModule
from posgpt.training.distributed import check_strategy, rank_stopped, strategy_for
from posgpt.training.hardware import check_fp8, check_hardware, convert_to_fp8, resolve_precision, uses_cuda
from posgpt.training.logs import make_loggers
from posgpt.training.module import GPTModule
from posgpt.training.rundir import RunError, check_resume, check_writable, claim_run_dir, resume_path, write_configs

log = logging.getLogger(__name__)


def kept_original_length(cfg: RunConfig, resumed: Path | None) -> RunConfig:
    """`cfg` fine-tuning from a checkpoint (`init_from`) with a RoPE scaling, with the original length the scaling
    stretches from filled in: the checkpoint's own (`GPTConfig.original_length`), or where the run resumes, what it
    recorded. (Without a scaling the fine-tuned rotation is native to the new block_size, which is then its own.)"""
    ckpt = read_checkpoint(resumed, mmap=True) if resumed else starting_checkpoint(str(cfg.model.init_from), mmap=True)
    saved = model_config_of(ckpt)
    length = saved.original_block_size if resumed else saved.original_length
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, original_block_size=length))


def starting_checkpoint(source: str, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint `init_from` names, read; one line where there is no such file."""
    if not Path(source).expanduser().is_file():
        raise PretrainedError(f"--model.init_from {source}: no such checkpoint file, nor a directory or a name of "
                              "GPT-2's weights (gpt2, gpt2-medium, ...).")  # fmt: skip
    return read_checkpoint(Path(source).expanduser(), mmap=mmap)


def fine_tune_start(config: GPTConfig, tokenizer: Tokenizer) -> GPT:
    """A model of `config` holding, exactly, the weights of the checkpoint `config.init_from` names (a fine-tune:
    the optimizer, schedule and data start afresh): the checkpoint's model switched to `config`'s position settings
    (scaling, DroPE's NoPE, ...) at its own length, then its weights loaded into a model of `config`'s length; a
    learned table cut to it, refused past its end."""
    path = str(config.init_from)
    ckpt = starting_checkpoint(path, mmap=True)  # its weights are copied into the new model
    if (own := ckpt["hyper_parameters"]["tokenizer"]) != tokenizer.meta():
        raise PretrainedError(
            f"--model.init_from {path} reads text with its own tokenizer ({own['kind']}, {own['vocab_size']} tokens), "
            "the data's is another: fine-tune on its corpus (its run's config.yaml names it) or, for GPT-2's BPE, any "
            "text with --data.tokenizer gpt2."
        )
    model = gpt_from_checkpoint(ckpt, path)
    saved, rows = model.config, SCHEMES[model.config.pos_encoding].longest(model.config)
    if SCHEMES[config.pos_encoding].longest(config) is not None and rows is not None and config.block_size > rows:
        raise PretrainedError(
            f"--model.init_from {path} has {rows} learned positions: pass --model.block_size {rows} or less, or "
            "another --model.pos_encoding (its table is then replaced; none drops positions, as DroPE)."
        )
    kept = [f for f in GPTConfig.fields_with(Role.RESUME) if f not in GPTConfig.fields_with(Role.SWITCH)]
    at_saved_length = {f: getattr(saved, f) for f in ("block_size", *kept)}
    try:
        model.switch(dataclasses.replace(config, **at_saved_length))
    except ValueError as error:
        raise PretrainedError(
            f"--model.init_from {path}: {error} Pass the checkpoint's model settings (--config with its run's "
            "config.yaml), changing block_size and the position settings only."
        ) from None
    state = model.state_dict()
    if "pe.table.weight" in state and rows is not None:
        state["pe.table.weight"] = state["pe.table.weight"][: config.block_size]
    start = GPT(config)
    try:
        start.load_state_dict(state)
    except RuntimeError:  # a table sized by block_size (CoPE's counts)
        keep = " ".join(f"--model.{k} {v}" for k, v in SCHEMES[saved.pos_encoding].sized_settings(saved).items())
        raise PretrainedError(
            f"--model.init_from {path}: its weights do not fit a model of block_size {config.block_size} "
            f"({weights_misfit(start.state_dict(), state)}): pass {keep or f'--model.block_size {saved.block_size}'}."
        ) from None
    switched = [f"{f} {getattr(saved, f)} -> {getattr(config, f)}" for f in GPTConfig.fields_with(Role.SWITCH)
                if getattr(saved, f) != getattr(config, f)]  # fmt: skip
    log.info("Weights from %s (step %d, block_size %d -> %d%s)", path, ckpt.get("global_step", 0), saved.block_size,
             config.block_size, "".join(f", {change}" for change in switched))  # fmt: skip
    return start


@dataclass
class RunResult:
    run_dir: Path
    last_ckpt: Path
    best_ckpt: Path | None
    best_val_loss: float | None
    sample: str | None
    plot: Path | None = None


def preflight(cfg: RunConfig, resuming: bool) -> None:
    """Check what a run needs besides its text before preparing it (minutes for a large corpus): the checkpoint to
    resume from, a kernel for every layer on the run's device (the config's own checks know no device), GPT-2's
    tokenizer, and, unless `resuming` (its own weights), the weights `init_from` names."""
    resume_path(cfg.train.resume, Path(cfg.train.out_dir))  # a path must exist ('auto' may find none)
    accelerator = cfg.train.accelerator
    device = torch.device("cuda" if uses_cuda(accelerator) else "mps" if accelerator == "mps" else "cpu")
    float64 = resolve_precision(cfg.train.precision, accelerator).startswith("64")
    with torch.device("meta"):  # the shapes only: no memory, no initialisation cost
        model = GPT(cfg.model)
    for kind in model.kinds:  # a KernelError (flex on a CPU, heads under 16 on CUDA, float64) says what runs
        model.kernel(device, cfg.model.dropout > 0, needs_grad=True, float64=float64, kind=kind)
    if cfg.data.tokenizer == "gpt2":
        vocab_size = GPT2Tokenizer(cfg.data.tiktoken_ranks).vocab_size
        if cfg.model.init_from and not resuming and not names_checkpoint(cfg.model.init_from):
            check_pretrained(dataclasses.replace(cfg.model, vocab_size=vocab_size))


def prepared_data(cfg: DataConfig) -> PreparedData:
    """The prepared directory `cfg` names, prepared (or reused) under `prepared_root`; fields as `prepare_dir`'s."""
    fields = dataclasses.asdict(cfg)
    return prepare_dir(fields.pop("input"), fields.pop("dir"), **fields)


@dataclass
class TrainingData:
    """What a run trains on: batches, their tokenizer, the data's record for checkpoints, a name for run dirs."""

    datamodule: L.LightningDataModule
    tokenizer: Tokenizer
    record: dict[str, Any]
    name: str
    about: str = ""  # what the settings line says of the data


def corpus_data(cfg: RunConfig, prepared: PreparedData | None = None) -> TrainingData:
    """A prepared corpus (`cfg.data`, or `prepared`: a study's, prepared once for its runs)."""
    data = prepared or prepared_data(cfg.data)
    t, block = cfg.train, cfg.model.block_size
    eval_tokens = EVAL_BATCHES * t.batch_size * block if t.eval_tokens is None else t.eval_tokens  # 0: the whole split
    datamodule = TokenDataModule(data, block, t.batch_size, t.seed, eval_tokens)  # checks the splits
    v = datamodule.validation_record()
    source = data.meta.get("name") or (
        Path(data.meta["sources"][0]).stem if data.meta.get("sources") else data.path.name
    )
    name = f"{source}-{data.meta['tokenizer']['kind']}"
    about = (f"{source} ({data.meta['train_tokens']:,} tokens; validation scores {v['tokens']:,} of "
             f"{v['split_tokens']:,})")  # fmt: skip
    return TrainingData(datamodule, data.tokenizer(cfg.data.tiktoken_ranks), data.record(), name, about)


def task_data(task: TaskConfig, cfg: RunConfig) -> TrainingData:
    """A synthetic task (`data.tasks`): its own vocabulary, loss on the answers only."""
    datamodule = TaskDataModule(task, cfg.train.batch_size, cfg.train.seed)
    record = {"task": dataclasses.asdict(task), "fingerprint": task.fingerprint(), "prepared": f"task {task.name}"}
    return TrainingData(datamodule, datamodule.tokenizer, record, f"task-{task.name}", f"task {task.name}")


def run_dir_of(cfg: RunConfig, data: TrainingData) -> Path:
    name = "-".join([data.name, cfg.model.pos_encoding, *model_tags(cfg.model.to_dict())])  # a plain model's as ever
    return Path(cfg.train.out_dir) / (cfg.train.run_name or name)


@quiet_libraries()
def train(cfg: RunConfig, data: TrainingData | None = None) -> RunResult:
    """Prepare data (unless `data` is given: a task), build model and Trainer, fit, sample; the clock starts here."""
    t = cfg.train
    deadline = time.monotonic() + 60 * t.max_minutes if t.max_minutes else None
    check_hardware(t.accelerator)
    precision = resolve_precision(t.precision, t.accelerator)
    if t.fp8:
        check_fp8(t.accelerator, precision)
    check_strategy(t, precision)
    check_writable(Path(t.out_dir), "--train.out_dir")
    L.seed_everything(t.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    if data is None:
        preflight(cfg, resuming=t.resume is not None)
        data = corpus_data(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data.tokenizer.vocab_size))
    run_dir = run_dir_of(cfg, data)  # made by its lock (out_dir was checked), which removes it if the start is refused
    sources = data.record.get("sources") or []  # config.yaml: the corpus `auto` chose, the precision `auto` means
    chosen = str(sources[0]) if cfg.data.input == AUTO_CORPUS and len(sources) == 1 else cfg.data.input
    used = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, input=chosen), train=dataclasses.replace(t, precision=precision)
    )
    if rank_zero_only.rank != 0:  # DDP/FSDP workers: rank 0 holds the directory and has checked it
        run_dir.mkdir(parents=True, exist_ok=True)
        return _fit(cfg, used, data, run_dir, resume_path(t.resume, run_dir), deadline)
    try:
        with directory_lock(run_dir, tidy=True):
            ckpt_path = resume_path(t.resume, run_dir)
            if t.resume == "auto" and ckpt_path is None:
                log.info("--train.resume auto: no checkpoint in %s, so this is a fresh run", run_dir)
                old = run_dir.with_name(f"{data.name}-{cfg.model.pos_encoding}")  # layouts' name before issue 57
                if not t.run_name and old != run_dir and (old / "last.ckpt").is_file():
                    log.warning("%s may hold this model's run from before run names named layouts and layer options: "
                                "--train.run_name %s resumes it", old, old.name)  # fmt: skip
            claim_run_dir(run_dir, ckpt_path, t.overwrite, used)
            return _fit(cfg, used, data, run_dir, ckpt_path, deadline)
    except LockedError as error:
        raise RunError(
            f"{error}: another run is training into it. Wait for it, or pass another --train.run_name."
        ) from None


def _fit(
    cfg: RunConfig, used: RunConfig, data: TrainingData, run_dir: Path, ckpt_path: Path | None, deadline: float | None
) -> RunResult:
    """Build the module and the Trainer and fit; rank 0 writes `used` once the resume is allowed."""
    t = cfg.train
    start_step = 0
    if names_checkpoint(cfg.model.init_from) and cfg.model.scales_rope and cfg.model.original_block_size is None:
        cfg, used = (kept_original_length(c, ckpt_path) for c in (cfg, used))
    if ckpt_path is not None:
        ckpt = read_checkpoint(ckpt_path, mmap=True)  # its settings and step; Lightning loads the weights
        for change in check_resume(ckpt, ckpt_path, cfg, data.record):
            log.info("Resuming with %s", change)
        start_step = int(ckpt.get("global_step", 0))
    fine_tune = names_checkpoint(cfg.model.init_from) and ckpt_path is None  # a resume restores its own weights
    start = fine_tune_start(cfg.model, data.tokenizer) if fine_tune else None  # refused before the run dir is written
    if rank_zero_only.rank == 0:
        write_configs(run_dir, cfg, used)
    module = GPTModule(cfg, data.tokenizer.meta(), data.record)
    if start is not None:
        module.model = start
    elif cfg.model.init_from and ckpt_path is None:
        module.model = from_pretrained(cfg.model)
        log.info("Weights from %s (%s)", cfg.model.init_from, weights_file(cfg.model.init_from))
    module.model.activation_checkpointing = t.activation_checkpointing
    if t.fp8:
        log.info("FP8 training: %d linear layers through torchao's float8", convert_to_fp8(module.model))

    bar = t.progress_bar and sys.stdout.isatty()  # Lightning's bar where wanted in a terminal, else plain lines
    callbacks = [
        MetricsWriter(module.model.flops_per_token(cfg.model.block_size), t.log_interval),  # first: before a save
        LastCheckpoint(run_dir, t, deadline),
        L.pytorch.callbacks.ModelCheckpoint(
            dirpath=run_dir, filename="best", monitor="val/loss", mode="min", enable_version_counter=False
        ),
        ProgressBar() if bar else ProgressLines(t),
    ]
    if t.model_summary:
        callbacks.append(L.pytorch.callbacks.ModelSummary(max_depth=2))
    try:  # what Lightning refuses on the hardware `t` names becomes one message
        trainer = L.Trainer(
            accelerator=t.accelerator,
            devices=t.devices,
            strategy=strategy_for(t.strategy, t.rank_timeout),
            num_nodes=t.num_nodes,
            precision=used.train.precision,
            max_steps=t.max_steps,
            accumulate_grad_batches=t.grad_accum,
            val_check_interval=t.eval_interval * t.grad_accum,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            log_every_n_steps=t.log_interval,
            logger=make_loggers(t.logger, run_dir, start_step, t.wandb_project, dataclasses.asdict(cfg)),
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
            enable_progress_bar=bar,
            enable_model_summary=t.model_summary,
            default_root_dir=str(run_dir),
        )
    except (ValueError, TypeError, ImportError, MisconfigurationException) as error:
        raise RunError(
            f"Lightning cannot run --train.accelerator {t.accelerator} --train.devices {t.devices} "
            f"--train.strategy {t.strategy} here: {error}"
        ) from None
    if trainer.is_global_zero:
        if note := dropout_fallback(module.model, trainer.strategy.root_device):
            log.info(note)
        # the one line that says what this run is: model, data, precision, device, run dir and code version
        m, device = cfg.model, trainer.strategy.root_device
        model_words = ", ".join([m.pos_encoding, *model_tags(m.to_dict())])  # its layout and layer options too
        where = f"{trainer.world_size} x {device.type}" if trainer.world_size > 1 else str(device.type)
        dir_words = f"resuming from {ckpt_path} in" if ckpt_path else "run dir"
        log.info(
            f"{module.model.num_params() / 1e6:.2f}M parameters ({m.n_layer} layers x {m.n_embd}, {model_words}, "
            f"block {m.block_size}) on {data.about or data.name}; {trainer.precision} on {where}; {t.max_steps} steps "
            f"x {t.batch_size * t.grad_accum} x {m.block_size} tokens; {dir_words} {run_dir}; git {git_sha()}, torch "
            f"{torch.__version__}"
        )
    with warnings.catch_warnings():
        # config.yaml (and, on resume, the checkpoints) are meant to be in the run directory
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
        warnings.filterwarnings("ignore", message=r"It is recommended to use .* sync_dist=True")  # reduced already
        try:
            trainer.fit(module, datamodule=data.datamodule, ckpt_path=ckpt_path)
        except RuntimeError as error:  # a rank that died or hangs: one line, naming it where this rank can
            if (stopped := rank_stopped(trainer, error, t.rank_timeout)) is None:
                raise
            last = run_dir / "last.ckpt"
            kept = f"the last complete checkpoint, {last}, is intact" if last.is_file() else "no checkpoint was written"
            raise RunError(f"{stopped}; {kept}. Continue with the same command and --train.resume auto.") from None

    best = trainer.checkpoint_callback
    best_path = run_dir / Path(best.best_model_path).name if best and best.best_model_path else None
    best_loss = float(best.best_model_score) if best and best.best_model_score is not None else None
    sample, plot = None, None
    if trainer.is_global_zero and t.sample_tokens:  # a short sample, from the tokenizer's start token
        start = data.tokenizer.start_ids()
        idx = torch.tensor([start], dtype=torch.long, device=module.device)
        model = module.model  # sharded: its parameters are shards, the whole model is in last.ckpt
        if t.strategy in SHARDED:
            model = gpt_from_checkpoint(read_checkpoint(run_dir / "last.ckpt"), run_dir / "last.ckpt").to(idx.device)
        # eagerly, even for a compiled model: each new cache length would otherwise be a new compilation
        with torch.compiler.set_stance("force_eager"):
            out = model.eval().generate(idx, t.sample_tokens, temperature=0.8, top_k=200)
        sample = data.tokenizer.decode(out[0, len(start) :].tolist())
    if trainer.is_global_zero and t.logger != "none":  # every logger keeps the CSV record, drawn here
        for logger in trainer.loggers:
            logger.save()  # the rows still buffered (csv), the events flushed (tensorboard)
        try:
            plot = write_training_plot(run_dir)
        except UserError as error:  # no loss logged yet, or a disk that cannot take the figure: the run is done
            log.warning("No training.png: %s", error)
    return RunResult(run_dir, run_dir / "last.ckpt", best_path, best_loss, sample, plot)


def dropout_fallback(model: GPT, device: torch.device) -> str | None:
    """One line when attention dropout moves training off its fused kernel on `device` (FlexAttention has none)."""
    c = model.config
    if c.dropout == 0 or c.attn_backend != AUTO:  # a named kernel is what runs, or a refusal at the forward
        return None
    for kind in model.kinds:  # the first kind whose kernel dropout changes (a layout's; every layer without one)
        kernels = (model.kernel(device, dropout, needs_grad=True, kind=kind) for dropout in (True, False))
        with_dropout, without = (kind.attention.kernel_name(kernel) for kernel in kernels)
        if with_dropout != without:
            break
    else:
        return None
    k = kind.config
    what = f"pos_encoding={k.pos_encoding}" + (f", attn_window={k.attn_window}" if k.attn_window else "")
    return (
        f"model.dropout {c.dropout}: attention with {what} runs on {with_dropout} with a float mask, not {without} "
        "(which has no attention dropout); slower and more memory at long contexts. --model.dropout 0 keeps "
        f"{without}."
    )
