"""Reading checkpoints without a Trainer: a checkpoint alone rebuilds its model and tokenizer.

A checkpoint is Lightning's dictionary. `hyper_parameters` holds the resolved run config (as plain
dicts), the tokenizer description and the provenance of the training data (the prepared directory
and its fingerprint), and `state_dict` the `GPTModule`'s weights under `model.`. Nothing here
imports Lightning: sampling and evaluation read checkpoints through this module alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import UserError
from data.errors import DataError
from data.tokenizer import RANKS_ENV, Tokenizer, tokenizer_from_meta
from model import GPT, GPTConfig


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, unreadable, or does not fit what it is used for."""


@dataclass
class LoadedCheckpoint:
    model: GPT
    tokenizer: Tokenizer
    config: dict[str, Any]
    """The resolved run config: {"model": ..., "data": ..., "optim": ..., "train": ...}."""
    step: int
    data: dict[str, Any] | None
    """The training data's provenance ({"prepared", "fingerprint", "tokenizer", ...}); None in
    checkpoints written before it was recorded."""


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dictionary, or one clear error when the file is missing or not a checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint not found: {path}." + (" It is a directory." if path.is_dir() else ""))
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a truncated or foreign file fails in many ways inside torch.load
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated or corrupt?): {type(error).__name__}: {error}. "
            "Use another checkpoint (best.ckpt, or an earlier copy)."
        ) from None
    if not isinstance(ckpt, dict) or "config" not in ckpt.get("hyper_parameters", {}):
        raise CheckpointError(f"{path} is not a checkpoint written by this project's train.py.")
    return ckpt


def model_config_of(ckpt: dict[str, Any]) -> GPTConfig:
    return GPTConfig.from_dict(ckpt["hyper_parameters"]["config"]["model"])


def tiktoken_ranks(explicit: str | None, recorded: str | None) -> str | None:
    """The GPT-2 ranks file to use: the one passed now, else $POSGPT_TIKTOKEN_RANKS, else the one the
    checkpoint recorded (which may have moved since)."""
    return explicit or os.environ.get(RANKS_ENV) or recorded


def load_checkpoint(path: str | Path, ranks_path: str | None = None) -> LoadedCheckpoint:
    """Rebuild the model (on CPU, eval mode) and tokenizer that a checkpoint holds; refuse one whose
    weights are not finite (written by a diverged run)."""
    ckpt = read_checkpoint(path)
    hparams = ckpt["hyper_parameters"]
    model = GPT(model_config_of(ckpt))
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise CheckpointError(f"{path}: its weights do not fit its own config ({error}).") from None
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise CheckpointError(
            f"{path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}): the run that wrote it diverged. "
            "Use an earlier checkpoint, or retrain with a lower --optim.lr."
        )
    model.eval()
    recorded = hparams["config"]["data"].get("tiktoken_ranks")
    try:
        tokenizer = tokenizer_from_meta(hparams["tokenizer"], tiktoken_ranks(ranks_path, recorded))
    except DataError as error:
        raise CheckpointError(
            f"Cannot rebuild the tokenizer of {path}: {error} Pass the ranks file with the tiktoken_ranks option "
            f"(sample.py --tiktoken_ranks, evaluate.py --data.tiktoken_ranks) or set {RANKS_ENV}."
        ) from None
    data = hparams.get("data")
    return LoadedCheckpoint(model, tokenizer, hparams["config"], int(ckpt.get("global_step", 0)), data)
