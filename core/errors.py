"""The one base class of the errors a user can cause and fix, and the "did you mean" they suggest.

Every command ends a `UserError` with its message as one line on stderr and exit status
`exit_code`, never with a traceback (`core.cli`): 2, but for a run stopped by a signal, which exits
as the shell expects of a signalled process (128 + the signal's number; `TrainingStopped`). Anything
else that escapes a command is a bug and keeps its traceback.
"""

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
    """A setting, or a combination of settings, that cannot work; raised when a config is validated,
    before any data is prepared or any model built. A ValueError too, as config checks always were."""


def did_you_mean(name: str, names: Sequence[str], dashes: str) -> str:
    """'; did you mean --x?' for the closest of `names` to `name` (a misspelling, or a field without
    its group), or ''."""
    if not name:
        return ""
    tail = [n for n in names if n.endswith("." + name)]
    close = tail if len(tail) == 1 else difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"; did you mean {dashes}{close[0]}?" if close else ""
