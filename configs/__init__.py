"""The shipped run and study configurations (YAML), installed with the package so that `--config
configs/NAME.yaml` and the default run work from any directory and from a non-editable install."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

if __name__ != "posgpt.configs":  # `import configs` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.configs: import posgpt.configs")


def shipped(name: str) -> Path:
    """The shipped configuration file `name` (e.g. shakespeare_char.yaml)."""
    return Path(str(files(__name__) / name))
