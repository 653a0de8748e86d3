"""Benchmarks whose figures go into BENCHMARKS.md: `python bench.py MODE [options]` (or `posgpt bench MODE`).
The modes are in benchmarks/modes.py; `python bench.py --help` lists them."""

from posgpt.benchmarks.modes import DESCRIPTION, MODES
from posgpt.core.modes import run_modes

if __name__ == "__main__":
    run_modes("bench.py", DESCRIPTION, MODES)
