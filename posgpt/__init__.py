"""posgpt: a small decoder-only GPT trainer for positional-encoding research; `posgpt` (posgpt/cli.py) runs every tool.

Its packages are `posgpt.model`, `posgpt.data`, `posgpt.training`, ...: a checkout keeps them at its top (model/,
data/, ...) and links each from here (posgpt/model -> ../model), so Python, editors and type checkers find them as
files; a wheel holds copies. So the project claims one top-level name, and puts nothing on sys.path.
"""

import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

# The editable install's link tree (pyproject.toml) holds the files of its install time: import through the
# checkout's own posgpt/, so that a module added since imports without a reinstall.
__path__ = [str(Path(__file__).resolve().parent)]
_checkout = Path(__path__[0]).parent


class _CheckoutPackages(importlib.abc.MetaPathFinder):
    """Finds `posgpt.NAME` for each package NAME at the top of this checkout, and nothing else: for a checkout whose
    links are not directories (git on Windows without symlinks writes each as a small text file)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if not name.startswith("posgpt.") or name.count(".") != 1 or name == "posgpt.posgpt":
            return None
        package = _checkout / name.removeprefix("posgpt.")
        if not (package / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                      submodule_search_locations=[str(package)])  # fmt: skip


if not (Path(__path__[0]) / "model").is_dir() and (_checkout / "model" / "__init__.py").is_file():
    sys.meta_path.insert(0, _CheckoutPackages())  # before an editable install's finder of another checkout
