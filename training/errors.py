"""How a run ends early, as its user sees it: stopped (by a signal or its time limit) or diverged. Kept apart
from the callbacks that raise them so that the study commands can name them without importing Lightning."""

from __future__ import annotations

from core.errors import UserError

TIME_LIMIT_EXIT = 75
"""The exit status of a run stopped by `train.max_minutes` (sysexits' EX_TEMPFAIL: not finished, run
the same command again), so that a job script can loop until the work is done."""


class TrainingStopped(UserError):
    """Training stopped by a signal or by its time limit at an optimizer step; the message says
    where, what was saved and how to continue. A signal exits with 128 + its number, as a shell
    expects of a process a signal ended, the time limit with `TIME_LIMIT_EXIT`; the line is news,
    not an error."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def line(self) -> str:
        return str(self)


class TrainingDiverged(UserError):
    """A loss or the weights became NaN or inf; nothing of the diverged model was saved, and the
    message says what to change (exit status 2, as every user error)."""
