"""Sample from a trained checkpoint: `python sample.py --ckpt runs/NAME/last.ckpt --prompt "ROMEO:"`.

The checkpoint alone rebuilds model and tokenizer. Text goes to stdout (streamed token by token
for one sample in a terminal); speed goes to stderr, so stdout can be piped. The logic is in
evaluation/sampling.py.
"""

from __future__ import annotations

import sys

from core.cli import Command, run
from evaluation.sampling import SampleConfig, sample

COMMAND = Command("sample.py", SampleConfig, sample, __doc__.splitlines()[0], logs=False)

if __name__ == "__main__":
    try:
        run(COMMAND)
    except BrokenPipeError:  # e.g. `python sample.py ... | head`: the reader has what it wanted
        sys.stderr.close()
