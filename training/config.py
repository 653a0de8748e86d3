"""Run configuration: small typed dataclasses composed into `RunConfig`; each field's docstring is its --help."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from posgpt.core.errors import ConfigError
from posgpt.model import SCHEMES, GPTConfig
from posgpt.model.pretrained import check_gpt2_shape, names_checkpoint
from posgpt.model.roles import Role

SHARDED = ("fsdp2", "fsdp")
"""The `train.strategy` names that shard with FSDP2 (`fsdp`: an alias; Lightning's FSDP1 strategies are refused)."""
EVAL_BATCHES = 200  # of the default validation budget, as nanoGPT's eval_iters
PRECISIONS = ("auto", "32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true", "64")


def check_ranges(cfg: Any, section: str, at_least: dict[str, float], fractions: tuple[str, ...] = ()) -> None:
    """Each field of `fractions` in [0, 1); each of `at_least` a number at least its bound, or None where its type
    allows None (unset). A study's variant reaches here through `dataclasses.replace`, not the parser's types."""
    nullable = {f.name for f in dataclasses.fields(cfg) if "None" in str(f.type)}
    for name in fractions:
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ValueError(f"{section}.{name} must be in [0, 1), got {getattr(cfg, name)!r}.")
    for name, low in at_least.items():
        value = getattr(cfg, name)
        if value is None and name in nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
            raise ValueError(f"{section}.{name} must be at least {low}, got {value!r}.")


@dataclass
class DataConfig:
    """Where the tokens come from."""

    input: str | list[str] | None = "auto"
    """Text, JSON-lines or Parquet file(s), directory(ies), a saved dataset, hf:NAME[:CONFIG]:SPLIT[@REVISION],
    or a named corpus: shakespeare, python-docs, python-library, auto (docs/data.md)."""
    dir: str | None = None
    """A directory written by `posgpt prepare`; used instead of `input` when given."""
    tokenizer: Literal["char", "gpt2"] = "char"
    """char: one id per character of the corpus; gpt2: tiktoken's GPT-2 BPE."""
    glob: str = "*.txt"
    """File pattern used inside input directories."""
    val_fraction: float = 0.1
    """Share of the tokens, from the end of the corpus, held out for validation (at most val_max_tokens)."""
    errors: Literal["strict", "replace"] = "strict"
    """Invalid UTF-8: strict stops with an error, replace substitutes U+FFFD."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline GPT-2 BPE (or set POSGPT_TIKTOKEN_RANKS)."""
    prepared_root: str = "prepared"
    """Where token files prepared from `input` are written (and reused when unchanged)."""
    text_column: str = "text"
    """The column (JSON field) holding each document's text in JSON-lines, Parquet and datasets sources."""
    val_max_tokens: int | None = 5_000_000
    """Most tokens of the validation split (the last min(val_fraction of the tokens, this)); null: no cap."""

    def __post_init__(self) -> None:
        check_ranges(self, "data", {"val_max_tokens": 1}, ("val_fraction",))
        if not self.text_column:
            raise ValueError("data.text_column must name a column, got ''.")
        if not self.input and not self.dir:
            raise ValueError(
                "No data: pass --data.input FILE|DIR|hf:NAME:SPLIT|auto|shakespeare|python-docs|python-library or "
                "--data.dir DIR."
            )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then cosine decay to `min_lr`."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 1e-4
    """Learning rate at and after `decay_steps`."""
    warmup_steps: int = 100
    """Optimizer steps of linear warm-up."""
    decay_steps: int | None = None
    """Step at which the cosine reaches `min_lr` (default: train.max_steps)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2 (nanoGPT uses 0.99 for small batches of tokens, 0.95 for GPT-2)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices (2-D and up) only, not to biases, norms or gains."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr!r}.")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, optim.lr = {self.lr}], got {self.min_lr!r}.")
        bounds = {"warmup_steps": 0, "decay_steps": 1, "weight_decay": 0, "grad_clip": 0}
        check_ranges(self, "optim", bounds, ("beta1", "beta2"))


@dataclass
class TrainConfig:
    """The training loop, hardware, checkpoints and logs."""

    max_steps: int = 2000
    """Optimizer steps to train for."""
    batch_size: int = 12
    """Sequences per micro-batch (per device)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    eval_interval: int = 250
    """Evaluate on the validation split every this many optimizer steps (and at the end)."""
    eval_tokens: int | None = None
    """Validation tokens, from the start of the split (default: 200 batches' worth, as nanoGPT; 0: the whole split)."""
    log_interval: int = 10
    """Log training metrics every this many optimizer steps."""
    ckpt_interval: int = 250
    """Write last.ckpt every this many optimizer steps (and at the end)."""
    keep_every: int = 0
    """Also keep every this many steps' checkpoint as step-NNNNNNN.ckpt (0: none); a multiple of ckpt/eval_interval."""
    keep_last: int = 0
    """How many step-numbered checkpoints to keep, the latest (0: all)."""
    max_minutes: float = 0.0
    """Save last.ckpt and exit with status 75 within this many minutes (0: no limit); train.resume auto continues."""
    seed: int = 1337
    """Seed for initialisation, dropout and the training data stream."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    run_name: str | None = None
    """Run directory name under out_dir (default: <data>-<tokenizer>-<pos_encoding>, then any layout and layer option:
    -3local-global-n_kv_head=2)."""
    resume: str | None = None
    """'auto' resumes from <run dir>/last.ckpt when it exists; or a checkpoint path."""
    precision: str = "auto"
    """Lightning precision: auto (the fastest that trains correctly here), 32-true, bf16-mixed, 16-mixed, ..."""
    compile: bool = False
    """Compile the model with torch.compile."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode with --train.compile (max-autotune: minutes of compilation; reduce-overhead: CUDA graphs)."""
    activation_checkpointing: bool = False
    """Recompute each block in the backward pass instead of keeping its activations (long contexts)."""
    fp8: bool = False
    """Train the blocks' linear layers in FP8 (torchao; a GPU of compute capability 8.9+, bf16 precision)."""
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps"] = "auto"
    """Lightning accelerator: auto, cpu, gpu/cuda, mps."""
    devices: int | str = "auto"
    """Devices per node (a count, 'auto', or a list such as '0,1')."""
    strategy: str = "auto"
    """Lightning strategy: auto, ddp, fsdp2 (FSDP2: parameters, gradients and optimizer state sharded; fsdp is an
    alias), ..."""
    num_nodes: int = 1
    """Number of machines."""
    rank_timeout: float = 600.0
    """Seconds a rank waits for the others (to start, in a collective, while rank 0 writes a checkpoint) before the
    run stops: a rank that died or hangs, under ddp and fsdp2."""
    logger: Literal["csv", "tensorboard", "wandb", "none"] = "csv"
    """What logs the metrics beside <run dir>/metrics.csv, which every run keeps (one file across resumes) and draws
    into training.png: csv (nothing more), tensorboard, wandb (offline without an API key); none: no metrics."""
    wandb_project: str = "posgpt"
    """wandb project name."""
    sample_tokens: int = 300
    """Characters/tokens of text to sample and print when training ends (0: none)."""
    progress_bar: bool = True
    """Lightning's progress bar when stdout is a terminal; else, or with false, a plain line every print_interval."""
    print_interval: int = 0
    """Steps between the plain progress lines (0: about 20 lines a run, at a multiple of log_interval)."""
    model_summary: bool = False
    """Print Lightning's table of the model's modules at the start (the settings line gives the parameter count)."""
    overwrite: bool = False
    """Start afresh in a run directory that holds an earlier run's checkpoints, deleting them."""
    random_positions: int = 0
    """Randomized positions (Ruoss et al. 2023): training positions an increasing random subset of [0, N); 0: off."""

    switch_at: float = 0.0
    """Switch the model to switch_model, keeping its weights, at this fraction of max_steps or step (>= 1); 0: never."""
    switch_model: dict[str, Any] = field(default_factory=dict)
    """The model fields that change at switch_at: the position scheme, the mask, the log-length scaling, the kernel."""

    def switch_step(self) -> int | None:
        """The optimizer step at which the model switches (None: never)."""
        if not self.switch_at:
            return None
        return round(self.switch_at * self.max_steps) if self.switch_at < 1 else int(self.switch_at)

    def __post_init__(self) -> None:
        positive = ("max_steps", "batch_size", "grad_accum", "eval_interval", "log_interval", "ckpt_interval")
        counts = ("eval_tokens", "max_minutes", "sample_tokens", "random_positions", "keep_every", "keep_last")
        bounds = dict.fromkeys(positive, 1) | dict.fromkeys(counts, 0) | {"num_nodes": 1, "print_interval": 0}
        bounds["rank_timeout"] = 1
        check_ranges(self, "train", bounds)
        if self.keep_every and self.keep_every % self.ckpt_interval and self.keep_every % self.eval_interval:
            raise ValueError(
                f"train.keep_every {self.keep_every} must be a multiple of train.ckpt_interval {self.ckpt_interval} "
                f"or of train.eval_interval {self.eval_interval}: those are the steps a checkpoint is written at."
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision {self.precision!r} is not one of {', '.join(PRECISIONS)}.")
        if isinstance(self.devices, int) and not isinstance(self.devices, bool) and self.devices < 1:
            raise ValueError(
                f"train.devices must be at least 1 (or 'auto' or a list such as '0,1'), got {self.devices}."
            )
        at = self.switch_at
        if isinstance(at, bool) or at < 0 or (at >= 1 and at != int(at)):
            raise ValueError(f"train.switch_at must be a fraction in (0, 1), a step >= 1, or 0 (never); got {at!r}.")
        if bool(at) != bool(self.switch_model):
            raise ValueError(
                "train.switch_at and train.switch_model go together: the step, and what the model switches to "
                "(e.g. --train.switch_at 0.85 --train.switch_model '{pos_encoding: none, attn_log_scaling: fixed}')."
            )
        if self.run_name is not None and (not self.run_name or "/" in self.run_name or self.run_name in (".", "..")):
            raise ValueError(f"train.run_name must be a plain directory name, got {self.run_name!r}.")


def default_model() -> GPTConfig:
    """The default run's network: nanoGPT's CPU shape with RoPE (vocab_size is set from the tokenizer)."""
    return GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False, pos_encoding="rope")


@dataclass
class RunConfig:
    """Everything one training run needs, saved in the run directory and in each checkpoint; `RunConfig()` is the
    default run, `python train.py` with no options."""

    model: GPTConfig = field(default_factory=default_model)
    """The network (its vocab_size is the tokenizer's, set when training starts)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def switched_model(self) -> GPTConfig:
        """The model after `train.switch_at`: `model` with `train.switch_model` applied."""
        return dataclasses.replace(self.model, **self.train.switch_model)

    def __post_init__(self) -> None:
        if self.model.layout == ():  # (): the config of one kind's layers (model/layout.py), never a model's
            raise ValueError("model.layout [] names no kind: list each layer's kind, e.g. [local, global], or leave "
                             "layout out.")  # fmt: skip
        if changes := self.train.switch_model:
            switchable = GPTConfig.fields_with(Role.SWITCH)
            fixed = sorted(set(changes) - set(switchable))
            if fixed:
                raise ValueError(
                    f"train.switch_model cannot change {', '.join(fixed)}: a switch keeps the blocks' weights, so it "
                    f"changes only {', '.join(sorted(switchable))}."
                )
            try:
                self.switched_model()
            except (ConfigError, TypeError) as error:
                raise ValueError(f"train.switch_model: {error}") from None
            if self.train.switch_step() == 0:
                raise ValueError(f"train.switch_at {self.train.switch_at} of {self.train.max_steps} steps is step 0: "
                                 "switch later, or train the switched model from the start.")  # fmt: skip
        if self.model.init_from and not names_checkpoint(self.model.init_from) and self.data.tokenizer != "gpt2":
            raise ValueError(
                f"model.init_from {self.model.init_from} is a GPT-2 model, which reads GPT-2's tokens: pass "
                "--data.tokenizer gpt2."
            )
        if self.model.original_block_size is not None and not self.model.scales_rope:
            raise ValueError(
                "model.original_block_size is the length a rope_scaling stretches from: set rope_scaling, or leave "
                "original_block_size null (an unscaled rotation is native to block_size)."
            )
        check_gpt2_shape(self.model)
        n, block = self.train.random_positions, self.model.block_size
        if n and n < block:
            raise ValueError(f"train.random_positions {n} must be at least model.block_size {block} (0: off).")
        limit = SCHEMES[self.model.pos_encoding].longest(self.model)
        if n and limit is not None and n > limit:
            raise ValueError(
                f"train.random_positions {n}: {self.model.pos_encoding} positions exist up to {limit} "
                f"(model.block_size); raise model.block_size to {n} (the table then covers every position drawn)."
            )


def lr_factor(step: int, base_lr: float, min_lr: float, warmup: int, decay_steps: int) -> float:
    """Multiplier of `base_lr` at optimizer step `step`: linear warm-up, cosine to min_lr, then flat (nanoGPT's)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step > decay_steps:
        return min_lr / base_lr
    progress = (step - warmup) / max(1, decay_steps - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return (min_lr + coeff * (base_lr - min_lr)) / base_lr
