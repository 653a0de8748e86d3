"""`posgpt` and its commands: one name for every tool, short help pages, and a non-editable install
that trains from any directory with the configs it ships, its output a plain log."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import bench
from posgpt import cli as posgpt
from posgpt.core.cli import Command
from posgpt.core.modes import Lazy, mode_summary

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
    for name, mode in posgpt.MODES.items():
        assert re.search(rf"\b{name}\b.*{re.escape(mode_summary(mode))}", text), name
    assert list(posgpt.MODES) == COMMANDS and "extrapolation | synthetic" in text


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


TWICE = """
import atexit, collections, os, sys
def report():
    files = collections.Counter(os.path.realpath(m.__file__) for name, m in list(sys.modules.items())
                                if getattr(m, "__file__", None) and name != "__mp_main__")  # multiprocessing's alias
    root = os.path.realpath(os.environ["POSGPT_ROOT"]) + os.sep
    with open(os.environ["POSGPT_TWICE"], "w") as out:
        ours = (f for f, n in files.items() if n > 1 and f.startswith(root) and "site-packages" not in f)  # no .venv
        out.write("\\n".join(sorted(ours)))
atexit.register(report)
"""
"""A sitecustomize.py: at exit, writes the files the process loaded as modules under two names."""


def test_no_command_loads_a_module_under_two_names(tmp_path):
    """The documented ways to run the commands, `python -m posgpt ...` and the benchmark report's job process
    (`python -m posgpt.benchmarks.measure`), load each module once; the modules' old `python -m` names say where
    the command went."""
    (tmp_path / "sitecustomize.py").write_text(TWICE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "POSGPT_TWICE": str(tmp_path / "t"),
        "POSGPT_ROOT": str(ROOT),
    }
    for argv in (
        ["posgpt", "study", "synthetic", "--help"],
        ["posgpt.benchmarks.measure", str(tmp_path / "m.json"), "posgpt", "study", "extrapolation", "--help"],
    ):
        done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0 and "--config" in done.stdout, done.stderr
        assert (tmp_path / "t").read_text() == "", argv
    moved = subprocess.run([sys.executable, "-m", "posgpt.experiments.extrapolation"], cwd=ROOT, capture_output=True,
                           text=True)  # fmt: skip
    assert moved.returncode == 1 and "run `posgpt study extrapolation`" in moved.stderr, moved.stderr


OFFLINE = """
import urllib.error, urllib.request
def offline(*args, **kwargs):
    raise urllib.error.URLError("no network in tests")
urllib.request.urlopen = offline
"""
"""A sitecustomize.py: every Python process started with its folder on PYTHONPATH has no network."""

ALLOWED = [
    r"Could not download Tiny Shakespeare \(.*\): training on Python's bundled documentation instead .*",
    r"Wrote prepared/\S+: \d+ train and \d+ val tokens .*",
    r"[\d.]+M parameters \(1 layers x 32, learned, block 32\) on python-\S+ \([\d,]+ tokens; validation scores "
    r"[\d,]+ of [\d,]+\); \S+ on cpu; 40 steps x 4 x 32 tokens; run dir \S+; git \S+, torch \S+",
    r"step \d+/40 \| loss [\d.]+ \| [\d.]+ ms/step \| [\d.]+k? tok/s( \| ETA \d+:\d\d)?",
    r"step \d+/40 \| val loss [\d.]+ \| [\d.]+ s",
    r"\{\"run_dir\": .*\}",
]


@pytest.mark.slow
def test_a_non_editable_install_trains_offline_from_any_directory_into_a_plain_log(tmp_path):
    """Install this tree as pip installs it for a user (a wheel built from a copy, its dependencies those of this
    environment) into a directory of its own, and run its posgpt from an empty directory, offline, with a shipped
    config and the default data, stdout and stderr into a file: the offline line once, the prepare line, the
    settings line, plain progress lines, the sample and the summary; nothing else (no Lightning notices, model
    table, deprecation warnings, carriage returns or ANSI codes)."""
    source = tmp_path / "src"
    left_out = (".git", ".venv", "runs", "prepared", "reports", "build", "*.egg-info", "__pycache__", ".*cache")
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*left_out))
    site = tmp_path / "site"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    run = lambda *args, **kw: subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)  # noqa: E731
    installed = run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    "--target", str(site), str(source), env=env)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    assert not {"model", "data", "core", "training", "configs"} & {p.name for p in site.iterdir()}  # one name: posgpt
    offline = tmp_path / "offline"
    offline.mkdir()
    (offline / "sitecustomize.py").write_text(OFFLINE)
    # the install in place of site-packages, with no network
    env.update(PYTHONPATH=os.pathsep.join([str(offline), str(site)]), POSGPT_CACHE=str(tmp_path / "cache"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    assert _shadowed(work, env) == [], "the installed posgpt puts names of the checkout on the path"
    args = ["train", "--config", "configs/nanogpt_cpu.yaml", "--model.n_layer", "1", "--model.n_head", "2",
            "--model.n_embd", "32", "--model.block_size", "32", "--train.batch_size", "4", "--train.max_steps", "40",
            "--train.eval_interval", "20", "--train.eval_tokens", "1024", "--train.sample_tokens", "20",
            "--data.prepared_root", "prepared"]  # fmt: skip
    with open(tmp_path / "log.txt", "w") as log:
        posgpt_script = site / "bin" / "posgpt"  # the console script pip wrote
        done = subprocess.run([str(posgpt_script), *args], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=300)  # fmt: skip
    text = (tmp_path / "log.txt").read_text()
    assert done.returncode == 0, text
    assert "\r" not in text and "\x1b[" not in text
    head, sample, tail = re.split(r"^--- sample ---$|^--------------$", text, flags=re.M)
    lines = [line for line in (head + tail).splitlines() if line.strip()]
    for line in lines:
        assert any(re.fullmatch(pattern, line) for pattern in ALLOWED), f"unexpected line: {line!r}"
    assert sum("Could not download" in line for line in lines) == 1
    assert sum(line.startswith("step ") for line in lines) == 6  # every 10 steps (40 / 20, to log's 10) + 2 vals
    assert sample.strip()
    run_dir = next((work / "runs").iterdir())
    assert {"last.ckpt", "config.yaml", "metrics.csv", "training.png"} <= {p.name for p in run_dir.iterdir()}
    used = yaml.safe_load((run_dir / "config.yaml").read_text())
    asked = yaml.safe_load((run_dir / "requested.yaml").read_text())
    assert asked["data"]["input"] == "auto" and asked["train"]["precision"] == "auto"
    assert Path(used["data"]["input"]).name.startswith("python-") and Path(used["data"]["input"]).is_file()
    assert used["train"]["precision"] in ("bf16-mixed", "32-true") and used["model"]["pos_encoding"] == "learned"


def _shadowed(cwd: Path, env: dict[str, str]) -> list[str]:
    """The top-level names of this checkout (its folders and scripts) that a Python started in `cwd` finds after
    `import posgpt` here or in the installed copy: none may be found but posgpt, except outside both (another
    package's own `tests`, say)."""
    tops = {Path(f).parts[0] for f in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                                     text=True).stdout.split()}  # fmt: skip
    names = sorted(n.removesuffix(".py") for n in tops if n.removesuffix(".py").isidentifier()) or pytest.skip("no git")
    code = (
        "import importlib.util, json, pathlib, posgpt\n"
        "home = [pathlib.Path(p).resolve() for p in posgpt.__path__]\n"
        f"found = {{n: importlib.util.find_spec(n) for n in {names!r} if n != 'posgpt'}}\n"
        "inside = lambda s: s.origin and any(pathlib.Path(s.origin).resolve().is_relative_to(h) for h in home)\n"
        "print(json.dumps(sorted(n for n, s in found.items() if s and (inside(s) or not s.origin or "
        f"pathlib.Path(s.origin).resolve().is_relative_to({str(ROOT)!r})))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_posgpt_maps_the_checkouts_packages_and_nothing_else():
    """In a checkout, posgpt.NAME is each package at its top, through its link posgpt/NAME (as in the wheel): not its
    scripts, tests or posgpt itself again (which a package path over the whole top would)."""
    import importlib.util
    import pkgutil

    import posgpt

    packages = {p.parent for p in ROOT.glob("*/__init__.py")} - {ROOT / "posgpt", ROOT / "tests"}
    assert {m.name for m in pkgutil.iter_modules(posgpt.__path__)} == {"cli", "__main__"} | {p.name for p in packages}
    for name in ("posgpt", "train", "bench", "tests", "docs"):
        assert importlib.util.find_spec(f"posgpt.{name}") is None, name
    for package in packages:
        assert Path(importlib.util.find_spec(f"posgpt.{package.name}").origin).resolve() == package / "__init__.py"


def test_the_editable_install_claims_one_top_level_name(tmp_path):
    """With the README's `pip install -e .`, a Python outside the checkout imports posgpt from it, and finds none of
    the checkout's other top-level names (evaluate, train, model, tests, ...)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    origin = subprocess.run([sys.executable, "-c", "import posgpt; print(posgpt.__file__)"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)  # fmt: skip
    if origin.returncode or not Path(origin.stdout.strip()).resolve().is_relative_to(ROOT):
        pytest.skip("posgpt is not installed editable from this checkout")
    assert _shadowed(tmp_path, env) == []


def test_the_config_reference_lists_every_option_of_every_command():
    """docs/config.md's tables are written from the fields' docstrings: a field added without them fails here."""
    import typing

    from posgpt.core import cli

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
