"""Every option that the code names in a message, a log line or a help text is one that a command takes:
a renamed or removed option cannot linger in what users are told to type. (Which command's spelling a
message gets is core.cli.spell's, tested in test_cli.)"""

from __future__ import annotations

import ast
from pathlib import Path

from test_cli import COMMANDS

import bench
from posgpt import cli as posgpt
from posgpt.core import cli

from helpers import loaded, project_files

ROOT = Path(__file__).resolve().parents[1]
BENCH = loaded(bench.MODES)
NOT_OURS = {"short", "timeout"}  # git rev-parse --short (core/repo.py), pytest-timeout's (benchmarks/report.py)
EXAMPLES = {"x", "GROUP.OPTION"}  # core/cli.py's docstrings and usage line show the syntax on made-up names


def named_options() -> dict[str, set[str]]:
    """{option named in a string of the project's code: the files that name it}."""
    found: dict[str, set[str]] = {}
    for path in project_files("*.py"):  # never a .venv inside the checkout
        if "tests" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for match in cli.OPTION.finditer(node.value):
                    found.setdefault(match.group(1), set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_option_a_message_names_is_an_option_of_a_command():
    commands = [*COMMANDS.values(), *BENCH.values(), *(loaded(posgpt.MODES)[m] for m in ("plot", "check"))]
    accepted = set().union(*({*cli.options(command), *command.hidden} for command in commands))
    found = named_options()
    assert len(found) > 50  # the scan sees the messages
    unknown = {name: sorted(files) for name, files in found.items() if name not in accepted | NOT_OURS | EXAMPLES}
    assert not unknown
