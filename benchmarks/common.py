"""What the benchmark modes share: a table's device, peak memory and rows (each printed and appended to --json as
it finishes), the device's name, and nanoGPT's model imported from the peer directory."""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.util
import io
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from posgpt.core.device import pick_device_dtype
from posgpt.core.errors import ConfigError, did_you_mean
from posgpt.model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PEER = ROOT.parent / "shared" / "peers" / "nanoGPT"
CLEAR_REFS = Path("/proc/self/clear_refs")
SEED = 1337


def check_schemes(schemes: list[str], known: Sequence[str], prefix: str = "") -> None:
    for scheme in schemes:
        if scheme not in known:
            hint = did_you_mean(scheme, known, "")
            raise ConfigError(f"{prefix}no scheme {scheme!r}; choose among {', '.join(known)}{hint}")


def check_at_least(minimum: int, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < minimum:
            raise ConfigError(f"--{name} must be at least {minimum}, got {value}.")


class Bench:
    """What every row of a table shares: the options, the device, its peak memory and the rows so far. Peak memory
    is CUDA's max allocated bytes on a GPU; on a CPU the process's peak resident set, its high-water mark reset
    through /proc/self/clear_refs (None without it)."""

    def __init__(self, args: Any, dtype: str = "auto") -> None:
        self.args = args
        self.device, self.dtype = pick_device_dtype(args.device, dtype)
        self.name = device_name(self.device)
        self.cuda = self.device.type == "cuda"
        self.rss = not self.cuda and CLEAR_REFS.exists()
        if self.cuda:
            self.memory = "CUDA max allocated, weights included"
        elif self.rss:
            self.memory = "the process's peak RSS during the timed run: weights, cache, Python and torch"
        else:
            self.memory = "not measured on this system: -"
        self.memory_label = f"peak MiB ({self.memory})"
        self.rows: list[Any] = []
        self.peer: ModuleType | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_tokens(self, tokens: Iterator[Any]) -> tuple[float, float]:
        """(seconds to the first item, seconds to the last) of an iterator (decoded tokens, training steps), timed
        from before its first step (a generator does nothing until asked)."""
        self.sync()
        start, first = time.perf_counter(), None
        for _ in tokens:
            if first is None:
                self.sync()
                first = time.perf_counter() - start
        self.sync()
        return first or 0.0, time.perf_counter() - start

    def free(self) -> None:
        """Before a row builds its model: what the rows before it left freed."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.rss:
            CLEAR_REFS.write_text("5")  # Linux: reset the high-water mark to the current RSS

    def peak_mib(self) -> float | None:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if not self.rss:
            return None
        match = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
        return int(match.group(1)) / 1024 if match else 0.0  # the peak itself: a difference of RSS can go negative

    def load_peer(self, option: str | None) -> None:
        """nanoGPT's model.py in the --peer directory (default: DEFAULT_PEER) as `peer`, imported as module
        `nanogpt_peer_model` (not `model`, which is ours); where there is none, a note."""
        directory = DEFAULT_PEER if option is None else Path(option)
        file = directory / "model.py"
        if not file.is_file():
            print(f"note: no nanoGPT model.py in {directory}: its rows are skipped (--peer DIR to give it)")
            return
        spec = importlib.util.spec_from_file_location("nanogpt_peer_model", file)
        assert spec is not None and spec.loader is not None
        self.peer = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = self.peer  # its @dataclass looks the module up there
        spec.loader.exec_module(self.peer)

    def peer_model(self, shape: dict[str, int], seed: int, **fields: Any) -> Any:
        """nanoGPT's GPT at `shape` with no biases, as ours, and an output layer of our padded vocabulary (50304
        for GPT-2, as nanoGPT's own GPT-2 runs), built on the device from `seed`."""
        assert self.peer is not None
        vocab = GPTConfig(vocab_size=shape["vocab_size"]).padded_vocab_size
        config = self.peer.GPTConfig(**{**shape, "vocab_size": vocab}, dropout=0.0, bias=False, **fields)
        torch.manual_seed(seed)
        with contextlib.redirect_stdout(io.StringIO()), self.device:  # it prints its parameter count
            return self.peer.GPT(config)

    def add(self, row: Any, line: str, entry: dict[str, Any]) -> None:
        """Keep `row`, print its `line`, and append `entry` (the row and what a reader needs to reproduce it) to
        --json, with the date, device, torch version and the command that made it."""
        self.rows.append(row)
        print(line, flush=True)
        if self.args.json is None:
            return
        entry = {"date": datetime.date.today().isoformat(), "device": self.name, **entry, "memory": self.memory_label,
                 "torch": torch.__version__, "command": shlex.join(["python", *sys.argv])}  # fmt: skip
        with open(self.args.json, "a", encoding="utf-8") as file:
            file.write(json.dumps(entry) + "\n")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else None
    name = found.group(1).strip() if found else platform.machine()
    threads = torch.get_num_threads()
    return f"{os.cpu_count()}-core CPU ({name}), {threads} thread{'s' if threads > 1 else ''}"


def cell(value: float | None, fmt: str, scale: float = 1) -> str:
    return "-" if value is None else format(value * scale, fmt)


def table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table_head(head: list[str]) -> list[str]:
    return [table_line(head), "|" + "---|" * len(head)]
