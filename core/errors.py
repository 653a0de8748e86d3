"""The one base class of the errors a user can cause and fix (a command ends one in one line on stderr and
exit status `exit_code`, never a traceback), the ways a training run or study ends early, and the "did you mean"
they suggest."""

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


TIME_LIMIT_EXIT = 75  # of a run stopped by `train.max_minutes`: sysexits' EX_TEMPFAIL, run the same command again


class TrainingStopped(UserError):
    """Training stopped by a signal (exit status 128 + its number) or its time limit (`TIME_LIMIT_EXIT`); the
    message says what was saved and how to continue, as news, not an error."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def line(self) -> str:
        return str(self)


class TrainingDiverged(UserError):
    """A loss or the weights became NaN or inf; nothing of the diverged model was saved."""


def did_you_mean(name: str, names: Sequence[str], dashes: str) -> str:
    """'; did you mean --x?' for the closest of `names` to `name` (a misspelling, or a field without its group)."""
    tail = [n for n in names if n.endswith("." + name)]  # '' (no mode given) matches none, nor is any name close
    close = tail if len(tail) == 1 else difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"; did you mean {dashes}{close[0]}?" if close else ""
