"""Run configuration: small typed dataclasses, composed into `RunConfig`, parsed by jsonargparse.

Each field's docstring is its `--help` text. `configs/shakespeare_char.yaml` holds the default run;
other files in `configs/` override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from model import GPTConfig


@dataclass
class DataConfig:
    """Where the tokens come from."""

    input: str | list[str] | None = "auto"
    """Text file(s), directory(ies) (searched recursively with `glob`), or a named corpus: shakespeare (Tiny
    Shakespeare, cached or downloaded), python-docs (bundled with Python, no network), auto (shakespeare where it can
    be had, else python-docs)."""
    dir: str | None = None
    """A directory written by `python -m data.prepare`; used instead of `input` when given."""
    tokenizer: Literal["char", "gpt2"] = "char"
    """char: one id per character of the corpus; gpt2: tiktoken's GPT-2 BPE."""
    glob: str = "*.txt"
    """File pattern used inside input directories."""
    val_fraction: float = 0.1
    """Share of the tokens, from the end of the corpus, held out for validation."""
    errors: Literal["strict", "replace"] = "strict"
    """Invalid UTF-8: strict stops with an error, replace substitutes U+FFFD."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline GPT-2 BPE (or set POSGPT_TIKTOKEN_RANKS)."""
    prepared_root: str = "prepared"
    """Where token files prepared from `input` are written (and reused when unchanged)."""


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
    beta2: float = 0.95
    """AdamW beta2."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices (2-D and up) only, not to biases, norms or gains."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""


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
    eval_tokens: int = 0
    """Validation token budget: fixed windows from the start of the split; 0 uses the whole split."""
    log_interval: int = 10
    """Log training metrics every this many optimizer steps."""
    ckpt_interval: int = 250
    """Write last.ckpt every this many optimizer steps (and at the end)."""
    seed: int = 1337
    """Seed for initialisation, dropout and the training data stream."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    run_name: str | None = None
    """Run directory name under out_dir (default: <data>-<tokenizer>-<pos_encoding>)."""
    resume: str | None = None
    """'auto' resumes from <run dir>/last.ckpt when it exists; or a checkpoint path."""
    precision: str = "auto"
    """Lightning precision: auto (bf16-mixed on a GPU or CPU with bf16, 16-mixed on older GPUs, else 32-true),
    32-true, bf16-mixed, 16-mixed, ..."""
    compile: bool = False
    """Compile the model with torch.compile."""
    accelerator: str = "auto"
    """Lightning accelerator: auto, cpu, gpu/cuda, mps."""
    devices: int | str = "auto"
    """Devices per node (a count, 'auto', or a list such as '0,1')."""
    strategy: str = "auto"
    """Lightning strategy: auto, ddp, fsdp, ..."""
    num_nodes: int = 1
    """Number of machines."""
    logger: Literal["csv", "wandb", "none"] = "csv"
    """csv: <run dir>/logs/metrics.csv; wandb: offline (files in the run dir) when no API key is set."""
    wandb_project: str = "posgpt"
    """wandb project name."""
    sample_tokens: int = 200
    """Characters/tokens of text to sample and print when training ends (0: none)."""
    progress_bar: bool = True
    """Show Lightning's progress bar."""


@dataclass
class RunConfig:
    """Everything one training run needs; saved, resolved, in the run directory and in each checkpoint."""

    model: GPTConfig = field(default_factory=GPTConfig)
    """The network (model.vocab_size is set from the tokenizer)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
