"""The one base class of the errors a user can cause and fix (a command ends one in one line on stderr and
exit status `exit_code`, never a traceback), and the "did you mean" they suggest."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class UserError(Exception):
    """A problem the user can fix; the message says how."""

    exit_code: int = 2

    def line(self) -> str:
        """What the command prints to stderr before it exits."""
        return f"error: {self}"


class ConfigError(UserError, ValueError):
    """A setting, or a combination of settings, that cannot work; raised when a config is validated."""


def did_you_mean(name: str, names: Sequence[str], dashes: str) -> str:
    """'; did you mean --x?' for the closest of `names` to `name` (a misspelling, or a field without its group)."""
    if not name:
        return ""
    tail = [n for n in names if n.endswith("." + name)]
    close = tail if len(tail) == 1 else difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"; did you mean {dashes}{close[0]}?" if close else ""
