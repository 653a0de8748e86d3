"""Torch's CPU threads follow the cores other processes leave free while a command runs (docs/training.md): they wait
for each other actively, so a thread a core is the fastest alone and many times the slowest on shared cores."""

from __future__ import annotations

import contextlib
import os
import time
from contextvars import ContextVar


class FreeCores:
    """While a command runs (`with FreeCores():`), `revisit()` sets torch's thread count every `every` seconds to the
    usable cores less what other processes used of them meanwhile: at least one, at most torch's count at the first
    look. Not where the user chose a count (`USER_SETTINGS`, or `torch.set_num_threads` since) or off Linux."""

    USER_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # where a user chooses the count for the process

    every = 1.0  # seconds: 100-200 clock ticks a reading; a look between two costs a fraction of a microsecond

    def __init__(self) -> None:
        self.threads = self.most = 0  # not read from torch yet
        self.last = None if any(os.environ.get(name) for name in self.USER_SETTINGS) else self._reading()

    @staticmethod
    def _reading() -> tuple[float, float, float] | None:
        """(now, seconds every process has worked on the usable cores since boot, this one's); None off Linux."""
        with contextlib.suppress(OSError, ValueError, IndexError, AttributeError), open("/proc/stat") as stat:
            cpus, ticks = os.sched_getaffinity(0), 0
            for name, *fields in map(str.split, stat):  # cpuN user nice system idle iowait irq softirq steal ...
                if name[3:].isdigit() and int(name[3:]) in cpus:
                    ticks += sum(map(int, fields[:8])) - int(fields[3]) - int(fields[4])
            return time.monotonic(), ticks / os.sysconf("SC_CLK_TCK"), time.process_time()
        return None

    def revisit(self) -> None:
        """Follow the free cores if `every` seconds have passed since the last look."""
        if self.last is None or time.monotonic() - self.last[0] < self.every:
            return
        import torch  # imported by the loop that calls

        self.most = self.most or torch.get_num_threads()
        now = self._reading()
        if now is None or self.most == 1 or torch.get_num_threads() != (self.threads or self.most):
            self.last = None  # nothing to follow, or the user has set a count
            return
        others = (now[1] - self.last[1] - (now[2] - self.last[2])) / (now[0] - self.last[0])  # in cores
        self.threads = max(1, min(self.most, round(len(os.sched_getaffinity(0)) - others)))
        torch.set_num_threads(self.threads)
        self.last = now

    def __enter__(self) -> FreeCores:
        self.token = FOLLOWING.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        FOLLOWING.reset(self.token)
        if self.threads and self.last is not None:  # torch's count back, unless the user has set one
            import torch

            torch.set_num_threads(self.most)


FOLLOWING: ContextVar[FreeCores | None] = ContextVar("FOLLOWING", default=None)  # the running command's, if any


def revisit() -> None:
    """A step of a command's loop: follow the free cores if a second has passed; outside a command, nothing."""
    if (cores := FOLLOWING.get()) is not None:
        cores.revisit()
