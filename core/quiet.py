"""Quiet libraries: what Lightning announces and what libraries warn each other about stays out of a
command's output, which says what it does in its own lines."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
"""Loggers of Lightning's notices (devices available, AMP in use, a logging service's advertisement)."""


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Leave out Lightning's notices (its warnings stay) and the deprecation warnings that libraries raise
    about each other's APIs, which the user can do nothing about."""
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=r"(lightning|torch|lightning_utilities)\.")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
