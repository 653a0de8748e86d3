"""Reading a checkpoint file and checking that it is one of ours, without Lightning, the model or the data
(rebuilding them is `evaluation.checkpoint.load_checkpoint`), so that `data/` and `model/` may use its error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posgpt.core.errors import UserError


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, unreadable, or does not fit what it is used for."""


def read_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint dictionary, or one clear error when the file is missing or not a checkpoint; `mmap` maps
    its tensors instead of reading them (a few fields of a GPT-2-sized checkpoint in milliseconds)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint not found: {path}." + (" It is a directory." if path.is_dir() else ""))
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)  # plain data: no module path
    except Exception as error:  # a truncated or foreign file fails in many ways inside torch.load
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated or corrupt?): {type(error).__name__}: {error}. "
            "Use another checkpoint (best.ckpt, or an earlier copy)."
        ) from None
    if not isinstance(ckpt, dict) or "config" not in ckpt.get("hyper_parameters", {}):
        raise CheckpointError(f"{path} is not a checkpoint written by this project's train.py.")
    return ckpt
