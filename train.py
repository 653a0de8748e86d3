"""Train a GPT: `python train.py [--config configs/X.yaml] [--model.pos_encoding alibi ...]` (or `posgpt train`).

With no arguments it trains configs/shakespeare_char.yaml (Tiny Shakespeare, char-level, a few
minutes on a laptop CPU) and prints a short sample. `--help` lists every option. The logic is in
training/command.py.
"""

from __future__ import annotations

from core.cli import run
from training.command import COMMAND, DEFAULT_CONFIG, main, os_error_message

__all__ = ["COMMAND", "DEFAULT_CONFIG", "main", "os_error_message"]

if __name__ == "__main__":
    run(COMMAND)
