"""Quiet libraries: Lightning's notices and the libraries' warnings about each other stay out of a command's output."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")  # devices available, AMP in use, ...


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Leave out Lightning's notices (its warnings stay) and libraries' deprecation warnings about each other."""
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
