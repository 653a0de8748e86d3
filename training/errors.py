"""How a run ends early: stopped (by a signal or its time limit) or diverged; importable without Lightning."""

from __future__ import annotations

from core.errors import UserError

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
