"""`posgpt MODE [options]`: every command of the project under one name (installed by `pip install .`).
Each is imported when it runs, so `posgpt --help` imports no torch."""

from __future__ import annotations

from collections.abc import Sequence

from posgpt.core.modes import Lazy, Modes, run_modes

DESCRIPTION = (
    "A small decoder-only GPT trainer for positional-encoding research: train short, evaluate long, look inside."
)


def _lazy(module: str, summary: str) -> Lazy:
    """The mode of `module.COMMAND`, imported when it runs."""
    return Lazy(module, "COMMAND", summary)


MODES: Modes = {
    "train": _lazy("posgpt.training.command", "Train a GPT on any text; the position scheme is --model.pos_encoding."),
    "sample": _lazy(
        "posgpt.evaluation.sampling", "Sample from a trained checkpoint: --ckpt runs/NAME/last.ckpt --prompt 'ROMEO:'."
    ),
    "evaluate": _lazy(
        "posgpt.evaluation.run",
        "Perplexity against context length: --ckpt A.ckpt [B.ckpt ...] --eval.lengths 128 4096.",
    ),
    "attention": _lazy(
        "posgpt.evaluation.attention", 'Look inside trained models: --ckpt A.ckpt --prompt "ROMEO:" --out maps.'
    ),
    "prepare": _lazy("posgpt.data.prepare", "Tokenize text into train.bin / val.bin / meta.json."),
    "plot": _lazy(
        "posgpt.training.curves",
        "Draw a run's training curves (train and validation loss against steps and tokens, learning rate) into "
        "<run dir>/training.png.",
    ),
    "study": {
        "extrapolation": _lazy(
            "posgpt.experiments.extrapolation",
            "Train one model per position scheme, evaluate them all at every length, write a report.",
        ),
        "synthetic": _lazy(
            "posgpt.experiments.synthetic",
            "Train one model per position scheme on a synthetic task, test exact-match accuracy at every length.",
        ),
    },
    "bench": Lazy("posgpt.benchmarks.modes", "MODES", "decode | gpu | vs-nanogpt | report | memory | syncs"),
    "check": _lazy(
        "posgpt.evaluation.check",
        "Check every attention kernel this device runs against the float32 reference: run it first on a new GPU or "
        "a new torch.",
    ),
}
"""Where each command lives and its line in `posgpt --help` (tests/test_cli.py holds them to the commands')."""


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point."""
    run_modes("posgpt", DESCRIPTION, MODES, argv)
