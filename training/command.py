"""`train.py` / `posgpt train`: train a GPT, print a sample and where the checkpoints are."""

from __future__ import annotations

import dataclasses
import errno
import json

from posgpt.configs import shipped
from posgpt.core.cli import Command
from posgpt.training.config import RunConfig


def main(cfg: RunConfig) -> None:
    """Train, then print the sample and where the checkpoints are (Lightning imported here, not for --help)."""
    from lightning.pytorch.utilities import rank_zero_only

    from posgpt.training.run import RunError, train

    try:
        result = train(cfg)
    except OSError as error:  # disk full, a directory that cannot be written: a user can fix it
        where = f" ({error.filename})" if error.filename else ""
        message = f"{error.strerror or error}{where}. Check that the run and data directories can be written."
        if error.errno == errno.ENOSPC:
            message = (
                f"no space left on the device{where}. Checkpoints are written atomically, so the previous last.ckpt "
                "is intact: free some space and continue with the same command and --train.resume auto."
            )
        raise RunError(message) from error
    if rank_zero_only.rank != 0:  # another process of a run on several devices
        return
    if result.sample is not None:
        print(f"\n--- sample ---\n{result.sample}\n--------------")
    print(json.dumps({k: v for k, v in dataclasses.asdict(result).items() if k != "sample"}, default=str))  # paths


COMMAND = Command(
    "train.py",
    RunConfig,
    main,
    "Train a GPT on any text; the position scheme is --model.pos_encoding. With no options: "
    "configs/shakespeare_char.yaml (Tiny Shakespeare, char-level, 4 layers x 128, RoPE, 2000 steps).",
    default_config=str(shipped("shakespeare_char.yaml")),  # `python train.py` with no options
    hidden=frozenset({"model.vocab_size"}),  # the tokenizer's, set from the data: read in a run's config.yaml, unused
)
