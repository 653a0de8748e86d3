"""`posgpt` and its commands: one name for every tool, short help pages, and a non-editable install
that trains from any directory with the configs it ships."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bench
from core.cli import Command
from core.modes import Lazy, mode_summary
from posgpt import cli as posgpt

from helpers import loaded

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["train", "sample", "evaluate", "attention", "prepare", "plot", "study", "bench", "check"]


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        posgpt.main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def _commands(modes, words=()) -> list[tuple[str, ...]]:
    found = []
    for name, mode in modes.items():
        found += [(*words, name)] if isinstance(mode, Command) else _commands(mode, (*words, name))
    return found


def test_posgpt_help_lists_the_commands(capsys):
    text = _help(capsys, [])
    listed = re.findall(r"^  (\S+) ", text, flags=re.M)
    assert listed == COMMANDS
    assert "extrapolation | synthetic" in text


def test_each_lazy_modes_line_is_what_its_command_would_print():
    """posgpt's table of modes keeps each line without importing the command: held here to the command."""
    lazies = [(name, mode) for name, mode in posgpt.MODES.items() if isinstance(mode, Lazy)]
    lazies += [(name, mode) for name, mode in posgpt.MODES["study"].items()]
    assert len(lazies) == len(COMMANDS) + 1  # study's two, not study itself
    lazies += list(bench.MODES.items())
    for name, lazy in lazies:
        assert lazy.summary == mode_summary(lazy.load()), name


def test_posgpt_help_imports_no_torch():
    """`posgpt --help` is a table of lines: it imports no torch, Lightning or matplotlib (BENCHMARKS.md, issue 34)."""
    code = (
        "import sys\nfrom posgpt.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'lightning', 'matplotlib', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


@pytest.mark.slow
def test_a_non_editable_install_trains_from_any_directory(tmp_path):
    """Install this tree as pip installs it for a user (a wheel built from a copy, its dependencies those of this
    environment) into a directory of its own, and run its posgpt from an empty directory: a tiny training run
    of a shipped config."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "runs", "prepared", "reports", "*.egg-info",
                                                                "__pycache__", ".*cache"))  # fmt: skip
    site = tmp_path / "site"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    run = lambda *args, **kw: subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)  # noqa: E731
    installed = run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    "--target", str(site), str(source), env=env)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    assert not {"model", "data", "core", "training", "configs"} & {p.name for p in site.iterdir()}  # one name: posgpt
    env["PYTHONPATH"] = str(site)  # where the install went, in place of site-packages
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "t.txt").write_text("the king and the queen said to all men of the land\n" * 200)
    where = run(sys.executable, "-c", "import posgpt, training, configs; print(training.__file__)", cwd=work, env=env)
    assert where.stdout.startswith(str(site / "posgpt" / "_lib")), where  # the installed copy, not this tree
    trained = run(str(site / "bin" / "posgpt"), "train", "--config", "configs/nanogpt_cpu.yaml", "--data.input",
                  "t.txt", "--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size",
                  "16", "--train.max_steps", "3", "--train.batch_size", "2", "--train.eval_interval", "3",
                  "--train.eval_tokens", "64", "--train.sample_tokens", "0", cwd=work, env=env)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    run_dir = work / "runs" / "t-char-learned"  # the shipped config's scheme
    assert {"last.ckpt", "config.yaml", "metrics.csv", "training.png"} <= {p.name for p in run_dir.iterdir()}


def test_the_wheel_installs_every_package_of_the_checkout_under_posgpt():
    """pyproject.toml lists the packages (a wheel puts them under posgpt/_lib/): a new one must be added there."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    files = subprocess.run(["git", "ls-files", "*__init__.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    found = {Path(f).parent.as_posix().replace("/", ".") for f in files} - {"tests", "posgpt"}
    assert listed == {"posgpt"} | {f"posgpt._lib.{name}" for name in found}


def test_the_config_reference_lists_every_option_of_every_command():
    """docs/config.md's tables are written from the fields' docstrings: a field added without them fails here."""
    import typing

    from core import cli

    page = (ROOT / "docs" / "config.md").read_text()
    modes = loaded(posgpt.MODES)
    missing = []
    for words in _commands(modes):
        if words[0] == "bench":
            continue
        command = modes[words[0]] if len(words) == 1 else modes[words[0]][words[1]]
        leaves = [name for name, kind, group in cli._offered(command) if not group]
        for name in leaves:
            if name.startswith("run.") or typing.get_origin(name):  # a study's run: train's options
                continue
            if f"`--{name}`" not in page and f"`--{name.rpartition('.')[0]}.*`" not in page:  # a group by reference
                missing.append(f"{' '.join(words)}: --{name}")
    assert not missing, missing
