"""What the benchmark modes share: the device's name, peak memory of one row, nanoGPT's model
imported from the peer directory, table lines, and rows appended to a JSON-lines file."""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import importlib.util
import io
import json
import os
import platform
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PEER = ROOT.parent / "shared" / "peers" / "nanoGPT"


class PeakMemory:
    """Peak memory of one row: `start` before the model is built, `reset` after the warm-up,
    `peak_mib` after the timed run. CUDA's max allocated bytes on a GPU; on a CPU the process's
    peak resident set, its high-water mark reset through /proc/self/clear_refs (None without it)."""

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
        if not self.proc.exists():
            return None
        match = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
        return int(match.group(1)) / 1024 if match else 0.0  # the peak itself: a difference of RSS can go negative


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else None
    name = found.group(1).strip() if found else platform.machine()
    threads = torch.get_num_threads()
    return f"{os.cpu_count()}-core CPU ({name}), {threads} thread{'s' if threads > 1 else ''}"


def load_peer(option: str | None) -> Callable[..., Any] | None:
    """`peer_model` of nanoGPT's model.py in the --peer directory (default: DEFAULT_PEER), imported as module
    `nanogpt_peer_model` (not `model`, which is ours), or None with a note."""
    directory = DEFAULT_PEER if option is None else Path(option)
    file = directory / "model.py"
    if not file.is_file():
        print(f"note: no nanoGPT model.py in {directory}: its rows are skipped (--peer DIR to give it)")
        return None
    spec = importlib.util.spec_from_file_location("nanogpt_peer_model", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its @dataclass looks the module up there
    spec.loader.exec_module(module)
    return functools.partial(peer_model, module)


def peer_model(peer: ModuleType, shape: dict[str, int], device: torch.device, seed: int, **fields: Any) -> Any:
    """nanoGPT's GPT at `shape` with no biases, as ours, and an output layer of our padded vocabulary (50304 for
    GPT-2, as nanoGPT's own GPT-2 runs), built on `device` from `seed`."""
    vocab = GPTConfig(vocab_size=shape["vocab_size"]).padded_vocab_size
    config = peer.GPTConfig(**{**shape, "vocab_size": vocab}, dropout=0.0, bias=False, **fields)
    torch.manual_seed(seed)
    with contextlib.redirect_stdout(io.StringIO()), device:  # it prints its parameter count
        return peer.GPT(config)


def cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table_head(head: list[str]) -> list[str]:
    return [table_line(head), "|" + "---|" * len(head)]


def append_json(path: str | None, entry: dict[str, Any]) -> None:
    """Append one row to a JSON-lines file, with the date, torch version and the command that made it."""
    if path is None:
        return
    entry = {"date": datetime.date.today().isoformat(), **entry, "torch": torch.__version__,
             "command": shlex.join(["python", *sys.argv])}  # fmt: skip
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\n")
