"""posgpt: a small decoder-only GPT trainer for positional-encoding research; `posgpt` (posgpt/cli.py) runs every tool.

Its packages are `posgpt.model`, `posgpt.data`, `posgpt.training`, ...: a checkout keeps them at its top (model/,
data/, ...) and links each from here (posgpt/model -> ../model), so Python, editors and type checkers find them as
files; a wheel holds copies. So the project claims one top-level name, and puts nothing on sys.path.
"""

from pathlib import Path

# The editable install's link tree (pyproject.toml) holds the files of its install time: import through the
# checkout's own posgpt/, so that a module added since imports without a reinstall. Where the links are not
# directories (git on Windows without symlinks writes each as a small text file), the checkout's top is searched too.
__path__ = [str(Path(__file__).resolve().parent)]
if not (Path(__path__[0]) / "model").is_dir() and (Path(__path__[0]).parent / "model" / "__init__.py").is_file():
    __path__.append(str(Path(__path__[0]).parent))
