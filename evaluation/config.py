"""The options of an extrapolation evaluation, shared by `evaluate.py` and the studies' `eval:` section."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.device import pick_device_dtype
from core.errors import ConfigError
from model.config import RopeScaling


@dataclass
class EvalSettings:
    """How each checkpoint is evaluated: lengths, mode, budget, RoPE scaling, hardware."""

    lengths: list[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048, 4096])
    """Context lengths L to evaluate at, in tokens."""
    mode: Literal["nonoverlap", "sliding"] = "nonoverlap"
    """nonoverlap: windows of L, every token scored; sliding: windows advance by `stride`, their last S scored."""
    stride: int | None = None
    """Stride S of the sliding mode, at most the smallest length."""
    token_budget: int = 65536
    """Tokens scored at every length, from the start of the text, so lengths compare on equal footing."""
    rope_scaling: list[RopeScaling] = field(default_factory=lambda: ["none"])
    """RoPE checkpoints are evaluated once per entry: none (as trained), linear (position interpolation), ntk, yarn."""
    rope_scaling_factor: float | Literal["dynamic"] = "dynamic"
    """A fixed factor (>= 1) for the scaled RoPE variants, or 'dynamic': max(1, L / block_size) at each length L."""
    buckets: int = 16
    """Position buckets for the loss-by-position curves."""
    batch_tokens: int = 32768
    """Tokens per forward pass (fewer on CPU to bound the L x L scores; halved on a CUDA out-of-memory error)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Autocast dtype: auto is bfloat16 on a GPU that has it, float32 otherwise (losses in float32)."""
    progress: bool = True
    """Show a progress bar (on a terminal only: a log file gets none)."""
    attention_stats: bool = False
    """Also the attention statistics of attention_maps.py at every length: entropy, sink mass, sink rate and figures."""

    def __post_init__(self) -> None:
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive integers, got {self.lengths!r}.")
        self.lengths = sorted(set(self.lengths))
        if self.mode == "sliding":
            if self.stride is None:
                raise ValueError("mode 'sliding' needs --eval.stride S (the tokens scored per window).")
            if not 0 < self.stride <= self.lengths[0]:
                raise ValueError(f"stride must be in 1..{self.lengths[0]} (the smallest length), got {self.stride}.")
        elif self.stride is not None:
            raise ValueError("--eval.stride applies to --eval.mode sliding only; drop it or add --eval.mode sliding.")
        if self.token_budget < 1 or self.buckets < 1 or self.batch_tokens < 1:
            raise ValueError("token_budget, buckets and batch_tokens must be positive.")
        if self.rope_scaling_factor != "dynamic" and float(self.rope_scaling_factor) < 1:
            raise ValueError(f"rope_scaling_factor must be >= 1 or 'dynamic', got {self.rope_scaling_factor!r}.")
        pick_device_dtype(self.device, self.dtype)  # a device this machine has
        if not self.rope_scaling or len(set(self.rope_scaling)) != len(self.rope_scaling):
            raise ValueError(f"rope_scaling needs distinct entries (none = as trained), got {self.rope_scaling!r}.")


@dataclass
class EvalData:
    """The text to evaluate on (default: each checkpoint's own validation split)."""

    input: str | None = None
    """A text file, tokenized with each checkpoint's own tokenizer."""
    dir: str | None = None
    """A directory written by `python -m data.prepare` (its tokenizer must be the checkpoints')."""
    split: Literal["val", "train"] = "val"
    """Split of a prepared directory (or of each checkpoint's own data)."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline GPT-2 BPE (or set POSGPT_TIKTOKEN_RANKS)."""
    drop_unknown: bool = False
    """With --eval_data.input and a char-level checkpoint: leave out characters outside its vocabulary."""

    def __post_init__(self) -> None:
        if self.input and self.dir:
            raise ValueError("Pass either --eval_data.input FILE or --eval_data.dir PREPARED, not both.")


@dataclass
class EvaluateConfig:
    """evaluate.py's options: which checkpoints, their labels, where the report goes, how and on what text."""

    ckpt: list[str]
    """Checkpoints written by train.py."""
    labels: list[str] | None = None
    """A name per checkpoint (default: its run directory); a shared name marks seeds of one model: mean ± std."""
    out: str = "eval"
    """Directory for the results (created if needed)."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    """How each checkpoint is evaluated."""
    eval_data: EvalData = field(default_factory=EvalData)
    """The text (default: each checkpoint's own validation split)."""

    def __post_init__(self) -> None:
        if not self.ckpt:
            raise ValueError("Pass at least one checkpoint: --ckpt A.ckpt [B.ckpt ...].")
        if self.labels is not None and len(self.labels) != len(self.ckpt):
            raise ValueError(f"--labels gives {len(self.labels)} names for {len(self.ckpt)} checkpoints.")


def check_output_dir(out: str) -> None:
    """Stop before any evaluation when the results cannot be written to `out`."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a directory (created if needed) for the results.")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {existing} cannot be written; pass a directory you can write.")
