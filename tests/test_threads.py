"""Torch's threads follow the cores other processes leave free while a command runs (core/threads.py), and only
then: a count the user chose is kept, and a library call or an import changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from posgpt.core import threads
from posgpt.core.cli import Command, run


@dataclass
class NoOptions:
    pass


@pytest.fixture
def two_threads(monkeypatch):
    """Two torch threads (restored after), a look at the cores at every `revisit`, and other processes busy on
    `others[0]` of two cores (the machine's busy time grows by that plus this process' own)."""
    count = torch.get_num_threads()
    torch.set_num_threads(2)
    others, totals = [0.0], [0.0, 0.0, 0.0]  # seconds: wall clock, busy, this process'

    def reading() -> tuple[float, ...]:  # a second later: half a core's own work, and others'
        totals[:] = totals[0] + 1, totals[1] + others[0] + 0.5, totals[2] + 0.5
        return tuple(totals)

    for variable in threads.FreeCores.USER_SETTINGS:  # the tests choose a count (conftest.py): here no one has
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(threads.FreeCores, "every", 0.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threads.FreeCores, "_reading", staticmethod(reading))
    yield others
    torch.set_num_threads(count)


def command_threads(loads: list[float], others: list[float], between=lambda: None) -> list[int]:
    """Torch's thread count after each `revisit` of a command, with others busy on each of `loads` cores in turn."""
    seen = []

    def main(_: NoOptions) -> None:
        for load in loads:
            others[0] = load
            threads.revisit()
            seen.append(torch.get_num_threads())
            between()

    run(Command("test", NoOptions, main, logs=False), [])
    return seen


def test_a_command_takes_the_free_cores_and_gives_them_back(two_threads):
    assert command_threads([0.0, 1.0, 1.8, 0.4, 0.1], two_threads) == [2, 1, 1, 2, 2]
    assert torch.get_num_threads() == 2  # restored


@pytest.mark.parametrize("variable", threads.FreeCores.USER_SETTINGS)
def test_a_count_set_in_the_environment_is_kept(variable, two_threads, monkeypatch):
    monkeypatch.setenv(variable, "2")
    assert command_threads([1.0, 2.0], two_threads) == [2, 2]


def test_a_count_set_during_the_command_is_kept(two_threads):
    assert command_threads([1.0, 1.0, 1.0], two_threads, between=lambda: torch.set_num_threads(2)) == [1, 2, 2]
    assert torch.get_num_threads() == 2


def test_one_thread_stays_one(two_threads):
    torch.set_num_threads(1)  # the tests' workers' count (conftest.py): a command never raises it
    assert command_threads([0.0, 0.0], two_threads) == [1, 1]


def test_a_library_call_changes_nothing(two_threads):
    two_threads[0] = 2.0
    threads.revisit()
    assert torch.get_num_threads() == 2


@pytest.mark.slow
def test_an_import_changes_nothing():
    code = (
        "import torch; before = torch.get_num_threads(); import posgpt.cli, posgpt.training.run, "
        "posgpt.evaluation.run, posgpt.evaluation.sampling, posgpt.experiments.synthetic; "
        "print(before, torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k not in threads.FreeCores.USER_SETTINGS}  # torch's own count
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    before, after = done.stdout.split()
    assert before == after
