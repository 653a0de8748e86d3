"""Look inside trained models: `python attention_maps.py --ckpt A.ckpt --prompt "ROMEO:" --out maps`
(or `posgpt attention`). The logic is in evaluation/attention.py."""

from posgpt.core.cli import run
from posgpt.evaluation.attention import COMMAND

if __name__ == "__main__":
    run(COMMAND)
