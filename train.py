"""Train a GPT: `python train.py [--config configs/X.yaml] [--model.pos_encoding alibi ...]` (or `posgpt train`).
With no arguments it trains configs/shakespeare_char.yaml and prints a sample; the logic is in training/command.py."""

from posgpt.core.cli import run
from posgpt.training.command import COMMAND

if __name__ == "__main__":
    run(COMMAND)
