"""posgpt: a small decoder-only GPT trainer for positional-encoding research. The `posgpt` command
(posgpt/cli.py) runs every tool: train, sample, evaluate, attention, prepare, plot, study, bench.

The project's packages (model, data, core, training, evaluation, experiments, benchmarks, configs) sit at
the top of a checkout, where `python train.py` and `from model import GPT` find them. An installed wheel
keeps them in posgpt/_lib/, so that it claims no generic top-level name in site-packages: importing
posgpt (which the `posgpt` command does first) puts that folder on sys.path, and then `from model import
GPT` works there too. An editable install has no such folder: the checkout's top is put there instead.
"""

import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
_packages = str(_here / "_lib" if (_here / "_lib").is_dir() else _here.parent)
if _packages not in sys.path:
    sys.path.insert(0, _packages)
