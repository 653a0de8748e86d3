"""`posgpt` and its commands: one name for every tool, short help pages, and a non-editable install
that trains from any directory with the configs it ships, its output a plain log."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "runs", "prepared", "reports", "*.egg-info",
                                                                "__pycache__", ".*cache"))  # fmt: skip
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
    where = run(sys.executable, "-c", "import posgpt, training, configs; print(training.__file__)", cwd=work, env=env)
    assert where.stdout.startswith(str(site / "posgpt" / "_lib")), where  # the installed copy, not this tree
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
