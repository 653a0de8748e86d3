"""How `posgpt.NAME` is found: in a checkout through its links posgpt/NAME -> ../NAME, which type checkers read too;
through the checkout's top where the links are not directories; from the editable install's link tree, a module
added after the install; never under a bare name, and no package imports a root script (which a wheel does not hold)."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_config import _imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in ("posgpt", "tests"))
TOPS = {p.stem for p in ROOT.iterdir() if p.suffix == ".py"} | set(PACKAGES)
"""The checkout's top-level names other than posgpt: its scripts and its packages' bare names."""


def _python(code: str, cwd: Path, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_no_package_imports_a_root_script_or_a_package_by_its_bare_name(tmp_path):
    """A wheel holds no train.py (`posgpt bench syncs` imported it and failed there), and a bare name would load a
    second copy of every module."""
    files = [p for name in ("posgpt", *PACKAGES) for p in (ROOT / name).rglob("*.py")]
    bad = sorted(f"{p.relative_to(ROOT)}: {name}" for p in files for name in _imports(p) if name.split(".")[0] in TOPS)
    assert len(files) > 80 and not bad, bad
    (tmp_path / "m.py").write_text("def f():\n    import train\n    from model.gpt import GPT\n")
    assert {"train", "model.gpt.GPT"} <= {n for n in _imports(tmp_path / "m.py") if n.split(".")[0] in TOPS}


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imported_by_its_bare_name_is_refused_in_one_line_naming_posgpt(package):
    assert str(ROOT) in sys.path  # pytest's pythonpath: what the checkout's root is to a Python started there
    with pytest.raises(ImportError, match=rf"^this package is posgpt\.{package}: import posgpt\.{package}$"):
        importlib.import_module(package)


def test_a_module_the_editable_installs_link_tree_lacks_imports_from_the_checkout(tmp_path):
    """setuptools' strict editable install links each file of its install time; posgpt's package path is the checkout's
    own posgpt/, so a module added since imports without a reinstall (here: a tree with posgpt/__init__.py alone)."""
    tree = tmp_path / "tree" / "posgpt"
    tree.mkdir(parents=True)
    (tree / "__init__.py").symlink_to(ROOT / "posgpt" / "__init__.py")
    found = _python("import posgpt.model.config as m; print(m.__file__)", tmp_path, PYTHONPATH=str(tree.parent))
    assert Path(found).resolve() == ROOT / "model" / "config.py"


def test_where_the_links_are_files_posgpt_finds_the_packages_at_the_checkouts_top(tmp_path):
    """git without symlinks (Windows) writes posgpt/model as a text file `../model`: posgpt's path then holds the
    checkout's top, where the package is."""
    (tmp_path / "posgpt").mkdir()
    shutil.copy(ROOT / "posgpt" / "__init__.py", tmp_path / "posgpt")
    (tmp_path / "posgpt" / "model").write_text("../model")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "__init__.py").write_text("")
    (tmp_path / "model" / "gpt.py").write_text("")
    assert _python("import posgpt.model.gpt as m; print(m.__file__)", tmp_path) == str(tmp_path / "model" / "gpt.py")


@pytest.mark.slow
def test_type_checkers_resolve_posgpt_from_the_checkouts_root_and_from_outside(tmp_path):
    """mypy from the root reads posgpt/ and its links alone (no site-packages, so no install helps); from elsewhere,
    the README's editable install (its link tree and py.typed). Neither reports an import of posgpt or of a name of
    the checkout unresolved, and a lazy name of `posgpt.model` is its class. Other type errors are not this test's."""
    pytest.importorskip("mypy")
    outside = tmp_path / "outside"
    outside.mkdir()
    installed = _python("import posgpt; print(posgpt.__file__)", outside)
    places = {ROOT: ["--no-site-packages"]} | ({outside: []} if Path(installed).resolve().is_relative_to(ROOT) else {})
    unresolved = re.compile(rf'"(posgpt|{"|".join(TOPS)})(\.[\w.]+)?"  \[import-(not-found|untyped)\]$')
    for cwd, options in places.items():
        mypy = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                str(tmp_path / cwd.name), *options]  # fmt: skip
        package = subprocess.run([*mypy, "-p", "posgpt"], cwd=cwd, capture_output=True, text=True, timeout=300)
        assert re.search(r"\(checked \d{2,} source files\)|^Success", package.stdout, re.M), package.stdout[-2000:]
        assert not [line for line in package.stdout.splitlines() if unresolved.search(line)], cwd
        probe = subprocess.run([*mypy, "-c", "import posgpt.model\nreveal_type(posgpt.model.GPT)"], cwd=cwd,
                               capture_output=True, text=True, timeout=300)  # fmt: skip
        assert 'Revealed type is "def (config: posgpt.model.config.GPTConfig) -> posgpt.model.gpt.GPT"' in probe.stdout
    if len(places) == 1:
        pytest.skip("checked from the root only: posgpt is not installed editable from this checkout")
