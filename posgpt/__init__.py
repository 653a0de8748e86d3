"""posgpt: a small decoder-only GPT trainer for positional-encoding research; `posgpt` (posgpt/cli.py) runs every tool.

Its packages are `posgpt.model`, `posgpt.data`, `posgpt.training`, ...: an installed wheel holds them under posgpt/,
and a checkout keeps them at its top (model/, data/, ...), which this package's path then covers. So the project
claims one top-level name, and puts nothing on sys.path.
"""

from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "model").is_dir() and (_checkout / "model" / "__init__.py").is_file():
    __path__.append(str(_checkout))
