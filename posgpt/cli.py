"""`posgpt MODE [options]`: every command of the project under one name (installed by `pip install .`).

Each command's logic lives in the package that owns it; the top-level scripts (train.py, sample.py,
evaluate.py, attention_maps.py, bench.py) and `python -m data.prepare` / `python -m experiments.NAME`
run the same commands.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.cli import Modes, run_modes

DESCRIPTION = (
    "A small decoder-only GPT trainer for positional-encoding research: train short, evaluate long, look inside."
)


def modes() -> Modes:
    """The commands, by name (imported here, not at the module's import, so that importing posgpt is cheap)."""
    from benchmarks.modes import MODES as BENCH
    from data.prepare import COMMAND as PREPARE
    from evaluation.check import COMMAND as CHECK
    from evaluation.commands import ATTENTION, EVALUATE, SAMPLE
    from evaluation.curves import COMMAND as PLOT
    from experiments.extrapolation import COMMAND as EXTRAPOLATION
    from experiments.synthetic import COMMAND as SYNTHETIC
    from training.command import COMMAND as TRAIN

    return {
        "train": TRAIN,
        "sample": SAMPLE,
        "evaluate": EVALUATE,
        "attention": ATTENTION,
        "prepare": PREPARE,
        "plot": PLOT,
        "study": {"extrapolation": EXTRAPOLATION, "synthetic": SYNTHETIC},
        "bench": BENCH,
        "check": CHECK,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point."""
    run_modes("posgpt", DESCRIPTION, modes(), argv)
