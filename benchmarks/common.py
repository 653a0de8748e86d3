"""What the benchmark modes share: the device's name, peak memory of one row, nanoGPT's model
imported from the peer directory, and rows appended to a JSON-lines file."""

from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PEER = ROOT.parent / "shared" / "peers" / "nanoGPT"
"""Where the nanoGPT checkout for side-by-side rows lives (`../shared/peers/nanoGPT`)."""


class PeakMemory:
    """Peak memory of one row: `start` before the model is built, `reset` after the warm-up,
    `peak_mib` after the timed run. CUDA's max allocated bytes on a GPU; on a CPU the process's
    peak resident set (Python and torch included; the high-water mark is reset through
    /proc/self/clear_refs, so each row's peak is its own; None where that file is missing)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.proc = Path("/proc/self/clear_refs")

    @property
    def how(self) -> str:
        if self.cuda:
            return "CUDA max allocated, weights included"
        if self.proc.exists():
            return "the process's peak RSS during the timed run: weights, cache, Python and torch"
        return "not measured on this system: -"

    @property
    def label(self) -> str:
        return f"peak MiB ({self.how})"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.proc.exists():
            self.proc.write_text("5")  # Linux: reset the high-water mark to the current RSS

    def peak_mib(self) -> float | None:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return _status_mib("VmHWM") if self.proc.exists() else None  # a difference of RSS can go negative


def _status_mib(key: str) -> float:
    """A figure of /proc/self/status (in kB there) in MiB."""
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) / 1024 if match else 0.0


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else None
    name = found.group(1).strip() if found else platform.machine()
    threads = torch.get_num_threads()
    return f"{os.cpu_count()}-core CPU ({name}), {threads} thread{'s' if threads > 1 else ''}"


def load_peer(directory: Path) -> ModuleType | None:
    """nanoGPT's model.py as module `nanogpt_peer_model` (not `model`, which is ours), or None."""
    file = directory / "model.py"
    if not file.is_file():
        return None
    spec = importlib.util.spec_from_file_location("nanogpt_peer_model", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its @dataclass looks the module up there
    spec.loader.exec_module(module)
    return module


def append_json(path: str | None, entry: dict[str, Any]) -> None:
    """Append one row to a JSON-lines file, with the date, torch version and the command that made it."""
    if path is None:
        return
    entry = {"date": datetime.date.today().isoformat(), **entry, "torch": torch.__version__,
             "command": shlex.join(["python", *sys.argv])}  # fmt: skip
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\n")
