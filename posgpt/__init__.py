"""posgpt: a small decoder-only GPT trainer for positional-encoding research; `posgpt` (posgpt/cli.py) runs every tool.

Importing it puts the project's packages (model, data, core, ...) on sys.path: an installed wheel's
posgpt/_lib/, so that it claims no generic top-level name, or a checkout's top.
"""

import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
_packages = str(_here / "_lib" if (_here / "_lib").is_dir() else _here.parent)
if _packages not in sys.path:
    sys.path.insert(0, _packages)
