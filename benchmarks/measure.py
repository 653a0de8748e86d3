"""`python -m posgpt.benchmarks.measure FILE MODULE ARGS...`: run `python -m MODULE ARGS` in this process, then
write the peak CUDA memory it allocated to FILE (null where it used no GPU). The process of each job of
`bench.py report`; it imports nothing itself, so that a job costs what its command costs."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def measure(argv: list[str]) -> None:
    target, module, *args = argv
    sys.argv = [module, *args]
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    finally:
        torch = sys.modules.get("torch")
        cuda = torch is not None and torch.cuda.is_initialized()
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        Path(target).write_text(json.dumps({"peak_mib": peak}))
    sys.exit(code)


if __name__ == "__main__":
    measure(sys.argv[1:])
