"""`posgpt MODE [options]`: every command of the project under one name (installed by `pip install .`).
Each is imported when it runs, so `posgpt --help` imports no torch."""

from __future__ import annotations

from collections.abc import Sequence

from posgpt.core.modes import Lazy, Modes, run_modes

DESCRIPTION = (
    "A small decoder-only GPT trainer for positional-encoding research: train short, evaluate long, look inside."
)


MODES: Modes = {
    "train": Lazy("posgpt.training.command", "Train a GPT on any text; the position scheme is --model.pos_encoding."),
    "sample": Lazy(
        "posgpt.evaluation.sampling", "Sample from a trained checkpoint: --ckpt runs/NAME/last.ckpt --prompt 'ROMEO:'."
    ),
    "evaluate": Lazy(
        "posgpt.evaluation.run",
        "Perplexity against context length: --ckpt A.ckpt [B.ckpt ...] --eval.lengths 128 4096.",
    ),
    "attention": Lazy(
        "posgpt.evaluation.attention", 'Look inside trained models: --ckpt A.ckpt --prompt "ROMEO:" --out maps.'
    ),
    "prepare": Lazy("posgpt.data.prepare", "Tokenize text into train.bin / val.bin / meta.json."),
    "plot": Lazy(
        "posgpt.training.curves",
        "Draw a run's training curves (train and validation loss against steps and tokens, learning rate) into "
        "<run dir>/training.png.",
    ),
    "study": {
        "extrapolation": Lazy(
            "posgpt.experiments.extrapolation",
            "Train one model per position scheme, evaluate them all at every length, write a report.",
        ),
        "synthetic": Lazy(
            "posgpt.experiments.synthetic",
            "Train one model per position scheme on a synthetic task, test exact-match accuracy at every length.",
        ),
    },
    "bench": Lazy(
        "posgpt.benchmarks.modes", "decode | gpu | vs-nanogpt | report | memory | attention-cost | syncs", "MODES"
    ),
    "check": Lazy(
        "posgpt.evaluation.check",
        "Check every attention kernel this device runs against the float32 reference: run it first on a new GPU or "
        "a new torch.",
    ),
}
"""Where each command lives and its line in `posgpt --help` (tests/test_cli.py holds them to the commands')."""


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point."""
    run_modes("posgpt", DESCRIPTION, MODES, argv)
