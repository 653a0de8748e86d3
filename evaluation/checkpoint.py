"""A checkpoint alone rebuilds its model and tokenizer, without a Trainer: what sampling, evaluation and
the studies load. Imports neither Lightning nor `training/`, so scripts that only read checkpoints stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import CheckpointError, read_checkpoint
from data.dataset import checkpoint_tokenizer
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
    """The resolved run config."""
    step: int
    data: dict[str, Any] | None
    """The training data's provenance (None in checkpoints written before it was recorded)."""


def gpt_from_checkpoint(ckpt: dict[str, Any], path: str | Path) -> GPT:
    """The GPT that `ckpt` (read from `path`) holds (after `train.switch_at`, the one it switched to), on CPU
    in eval mode; weights that do not fit its config or are not finite are refused."""
    model = GPT(GPTConfig.from_dict(ckpt.get("model_config") or ckpt["hyper_parameters"]["config"]["model"]))
    state = {k[len(PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(PREFIX)}
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        misfit = weights_misfit(model.state_dict(), state) or str(error).strip().splitlines()[0]
        raise CheckpointError(
            f"{path}: its weights do not fit its own recorded config ({misfit}): the file was edited or written "
            "by other code. Use a checkpoint this trainer wrote, or retrain."
        ) from None
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise CheckpointError(
            f"{path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}): the run that wrote it diverged. "
            "Use an earlier checkpoint, or retrain with a lower --optim.lr."
        )
    return model.eval()


def weights_misfit(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str:
    """Why `state` does not load into a model whose state dict is `expected`, in one clause ('' if it does);
    PyTorch's own message lists every mismatch where a user needs the first."""
    wrong = [name for name, tensor in expected.items() if name in state and state[name].shape != tensor.shape]
    if wrong:
        more = f"; {len(wrong) - 1} more tensor(s) differ" if len(wrong) > 1 else ""
        name = wrong[0]
        return f"{name} is {tuple(state[name].shape)} in the file, {tuple(expected[name].shape)} for the config{more}"
    found = {"missing": [n for n in expected if n not in state], "unexpected": [n for n in state if n not in expected]}
    return "; ".join(
        f"{what} {', '.join(names[:2])}{' and more' if names[2:] else ''}" for what, names in found.items() if names
    )


def load_checkpoint(path: str | Path, ranks_path: str | None = None) -> LoadedCheckpoint:
    """The model (on CPU, eval mode) and tokenizer a checkpoint holds; `ranks_path` overrides the recorded
    GPT-2 ranks file."""
    ckpt = read_checkpoint(path)
    hparams = ckpt["hyper_parameters"]
    model = gpt_from_checkpoint(ckpt, path)
    recorded = hparams["config"]["data"].get("tiktoken_ranks")
    tokenizer = checkpoint_tokenizer(hparams["tokenizer"], recorded, ranks_path, path)
    return LoadedCheckpoint(model, tokenizer, hparams["config"], int(ckpt.get("global_step", 0)), hparams.get("data"))
