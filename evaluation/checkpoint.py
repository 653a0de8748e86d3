"""A checkpoint alone rebuilds its model and tokenizer: what sampling, evaluation, attention maps, the
experiments and the benchmarks load, without a Trainer.

Reading the file is `core.checkpoint`, the tokenizer `data.provenance`; this module builds the GPT
from the recorded config and weights and puts the pieces together. It imports neither Lightning nor
`training/`, so every script that only reads checkpoints stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import CheckpointError, read_checkpoint
from data.provenance import checkpoint_tokenizer
from data.tokenizer import Tokenizer
from model import GPT, GPTConfig

PREFIX = "model."
"""Where the `GPTModule` keeps the GPT's weights in its state dict."""


@dataclass
class LoadedCheckpoint:
    """What a checkpoint rebuilds: its model and tokenizer, and what it recorded of its run."""

    model: GPT
    tokenizer: Tokenizer
    config: dict[str, Any]
    """The resolved run config: {"model": ..., "data": ..., "optim": ..., "train": ...}."""
    step: int
    data: dict[str, Any] | None
    """The training data's provenance ({"prepared", "fingerprint", "tokenizer", ...}); None in
    checkpoints written before it was recorded."""


def model_config_of(ckpt: dict[str, Any]) -> GPTConfig:
    """The config of the model the checkpoint holds: the run's, or after a switch mid-training
    (`train.switch_at`) the one it switched to."""
    return GPTConfig.from_dict(ckpt.get("model_config") or ckpt["hyper_parameters"]["config"]["model"])


def gpt_from_checkpoint(ckpt: dict[str, Any], path: str | Path) -> GPT:
    """The GPT that the checkpoint dictionary `ckpt` (read from `path`) holds, on CPU in eval mode;
    refuse weights that do not fit its config or are not finite (written by a diverged run)."""
    model = GPT(model_config_of(ckpt))
    state = {k[len(PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(PREFIX)}
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
    return model.eval()


def load_checkpoint(path: str | Path, ranks_path: str | None = None) -> LoadedCheckpoint:
    """Rebuild the model (on CPU, eval mode) and tokenizer that a checkpoint holds; `ranks_path` is
    the GPT-2 ranks file to use instead of the recorded one."""
    ckpt = read_checkpoint(path)
    hparams = ckpt["hyper_parameters"]
    model = gpt_from_checkpoint(ckpt, path)
    recorded = hparams["config"]["data"].get("tiktoken_ranks")
    tokenizer = checkpoint_tokenizer(hparams["tokenizer"], recorded, ranks_path, path)
    return LoadedCheckpoint(model, tokenizer, hparams["config"], int(ckpt.get("global_step", 0)), hparams.get("data"))
