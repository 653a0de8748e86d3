"""Sample from a trained checkpoint: `python sample.py --ckpt runs/NAME/last.ckpt --prompt "ROMEO:"`
(or `posgpt sample`). The logic is in evaluation/sampling.py."""

from posgpt.core.cli import run
from posgpt.evaluation.sampling import COMMAND

if __name__ == "__main__":
    run(COMMAND)
