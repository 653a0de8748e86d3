"""Perplexity against context length: `python evaluate.py --ckpt A.ckpt [B.ckpt ...] --eval.lengths 128 4096`
(or `posgpt evaluate`). The logic is in evaluation/run.py."""

from posgpt.core.cli import run
from posgpt.evaluation.run import COMMAND

if __name__ == "__main__":
    run(COMMAND)
