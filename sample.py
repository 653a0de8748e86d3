"""Sample from a trained checkpoint: `python sample.py --ckpt runs/NAME/last.ckpt --prompt "ROMEO:"`
(or `posgpt sample`). The logic is in evaluation/sampling.py."""

from core.cli import run
from evaluation.sampling import COMMAND

if __name__ == "__main__":
    run(COMMAND)
