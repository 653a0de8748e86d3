"""Look inside trained models: `python attention_maps.py --ckpt A.ckpt --prompt "ROMEO:" --out maps`
(or `posgpt attention`). The logic is in evaluation/commands.py and evaluation/attention_maps.py."""

from core.cli import run
from evaluation.commands import ATTENTION as COMMAND

if __name__ == "__main__":
    run(COMMAND)
