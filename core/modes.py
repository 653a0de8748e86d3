"""`prog MODE [options]`: a command line of modes (`posgpt train`, `bench.py decode`), each a `Command` or modes
of its own; a `Lazy` one is imported only when it runs, so that `posgpt --help` imports no torch."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

from posgpt.core.cli import Command, UsageError, run
from posgpt.core.errors import did_you_mean


@dataclass(frozen=True)
class Lazy:
    """A mode whose `Command` (or modes) is `module.attribute`, imported when the mode runs."""

    module: str
    summary: str
    """Its line in the modes' help: the command's `summary`, or its modes joined by ' | '."""
    attribute: str = "COMMAND"

    def load(self) -> Command | Modes:
        return getattr(importlib.import_module(self.module), self.attribute)


Modes = Mapping[str, Union[Command, Lazy, "Modes"]]
"""A command line of modes: each a command, a lazy one, or modes of its own."""


def run_modes(prog: str, description: str, modes: Modes, argv: Sequence[str] | None = None) -> None:
    """`prog MODE [options]`: run the mode's command (its usage line naming `prog MODE`), or read its next word."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # the usage line, the description and a line per mode
        head = f"{description.strip()}\n\n" if description.strip() else ""
        print(f"usage: {prog} MODE [options]\n\n{head}modes ({prog} MODE --help lists its options):")
        print("\n".join(f"  {name:16s} {mode_summary(mode)}" for name, mode in modes.items()))
        sys.exit(0)
    if not argv or argv[0] not in modes:
        given = f"unknown mode {argv[0]!r}" if argv else "no mode given"
        hint = did_you_mean(argv[0] if argv else "", list(modes), "")
        error = UsageError(f"{prog} MODE", f"{given} (modes: {', '.join(modes)}){hint}")
        print(error.line(), file=sys.stderr)
        sys.exit(error.exit_code)
    mode = modes[argv[0]]
    mode = mode.load() if isinstance(mode, Lazy) else mode
    if isinstance(mode, Command):
        run(dataclasses.replace(mode, prog=f"{prog} {argv[0]}"), argv[1:])
    else:
        run_modes(f"{prog} {argv[0]}", "", mode, argv[1:])


def mode_summary(mode: Command | Lazy | Modes) -> str:
    """A mode's line in the help: its command's first sentence (of its first paragraph), or its modes."""
    if isinstance(mode, Lazy):
        return mode.summary
    if not isinstance(mode, Command):
        return " | ".join(mode)
    paragraph = " ".join(mode.description.strip().split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s+(?=[A-Z])", paragraph, maxsplit=1)[0]
