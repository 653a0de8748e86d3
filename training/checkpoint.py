"""Reading checkpoints without a Trainer: a checkpoint alone rebuilds its model and tokenizer.

A checkpoint is Lightning's dictionary; `hyper_parameters` holds the resolved run config (as plain
dicts) and the tokenizer description, and `state_dict` the `GPTModule`'s weights under `model.`.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.tokenizer import Tokenizer, tokenizer_from_meta
from model import GPT, GPTConfig

CHANGEABLE_ON_RESUME = frozenset({"attn_backend", "dropout", "rope_scaling", "rope_scaling_factor"})
"""Model fields that a resumed run may change: the weights keep their shapes and meaning (RoPE
scaling is how position interpolation fine-tunes a trained model for longer contexts)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit what it is used for."""


@dataclass
class LoadedCheckpoint:
    model: GPT
    tokenizer: Tokenizer
    config: dict[str, Any]
    """The resolved run config: {"model": ..., "data": ..., "optim": ..., "train": ...}."""
    step: int


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dictionary, or one clear error when the file is missing or not a checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint not found: {path}.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as error:
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {error}") from None
    if not isinstance(ckpt, dict) or "config" not in ckpt.get("hyper_parameters", {}):
        raise CheckpointError(f"{path} is not a checkpoint written by this project's train.py.")
    return ckpt


def model_config_of(ckpt: dict[str, Any]) -> GPTConfig:
    return GPTConfig.from_dict(ckpt["hyper_parameters"]["config"]["model"])


def load_checkpoint(path: str | Path, ranks_path: str | None = None) -> LoadedCheckpoint:
    """Rebuild the model (on CPU, eval mode) and tokenizer that a checkpoint holds."""
    ckpt = read_checkpoint(path)
    hparams = ckpt["hyper_parameters"]
    model = GPT(model_config_of(ckpt))
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    model.load_state_dict(state)
    model.eval()
    tokenizer = tokenizer_from_meta(hparams["tokenizer"], ranks_path or hparams["config"]["data"].get("tiktoken_ranks"))
    return LoadedCheckpoint(model, tokenizer, hparams["config"], int(ckpt.get("global_step", 0)))


def check_same_model(path: str | Path, config: GPTConfig) -> None:
    """Refuse to resume from a checkpoint whose model differs from `config`, naming the differences."""
    saved = model_config_of(read_checkpoint(path))
    diffs = {
        k: (v, getattr(config, k))
        for k, v in saved.to_dict().items()
        if k not in CHANGEABLE_ON_RESUME and getattr(config, k) != v
    }
    if diffs:
        listed = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
        raise CheckpointError(
            f"Cannot resume from {path}: it holds a different model ({listed}). Use the same model "
            "settings, or start a fresh run (another --train.run_name, or no --train.resume)."
        )


def pick_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """Where and in what dtype to run a loaded checkpoint: 'auto' is CUDA when present, else CPU,
    and bfloat16 on a GPU that has it, else float32. A CUDA device on a machine without one is an
    error that says so."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here; use --device cpu or auto.")
    if dtype == "auto":
        bf16 = dev.type == "cuda" and torch.cuda.is_bf16_supported()
        return dev, torch.bfloat16 if bf16 else torch.float32
    return dev, getattr(torch, dtype)
