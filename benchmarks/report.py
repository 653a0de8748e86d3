"""What a machine does with posgpt, in parts of about 8 minutes: `python bench.py report` (`posgpt bench
report`), one front door over the commands that measure it.

Each part is a list of jobs, and each job one run of an existing command in a process of its own (a
hang, a crash or an exhausted GPU ends that job only), under its own time limit:
- check: `posgpt check` (every kernel against the float32 reference) and `pytest -m gpu`;
- train: `bench.py gpu` at 16 x 1024, one job per row of its scheme set (RoPE's job also runs the
  Lightning trainer's row and nanoGPT's, in the same process, for their ratios), FP8, and FSDP at world
  size 1 with its exact resume (tests/test_gpu.py);
- decode: `bench.py decode` for learned, RoPE and ALiBi, eager and compiled, at batch 1 and 64;
- long: one compiled training step per scheme at 16384 and 32768 tokens (`bench.py gpu`), and
  `evaluate.py` at both lengths on RoPE and ALiBi checkpoints of the 124M shape trained for 2 steps on
  Python's own documentation (`data.corpora.python_docs_path`: nothing downloaded).

Every job ends as one line of `--out` (JSON lines) when it finishes: its status (ok, failed, refused
with the command's one-line reason, out of time), wall time, the process's peak CUDA memory and the
rows its command measured. Running a part again skips the jobs already in the file, so a part cut off
by `--budget` (a machine's limit per command) loses nothing: run the same command again. At the end,
and with `--render FILE` alone, the file becomes a markdown report (device, torch, CUDA, each table,
each measured ratio beside its target) ready for BENCHMARKS.md.

It runs from a checkout with `PYTHONPATH=.` and needs no network. On a CPU the same jobs run shrunk (the
tiny model, eager), which is what the test suite runs.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from benchmarks.common import DEFAULT_PEER, ROOT, device_name
from benchmarks.gpu_rows import SCHEMES
from benchmarks.report_render import render
from core.cli import Command
from core.errors import ConfigError
from core.files import atomic_write_bytes
from data.corpora import python_docs_path

PARTS = ("check", "train", "decode", "long")
DECODE_SCHEMES = ("learned", "rope", "alibi")
LONG_EVAL = ("rope", "alibi")


@dataclass
class ReportConfig:
    """What this machine does with posgpt: kernel checks, training, decoding and long-context speed,
    one job per process, each line of --out written as it finishes, and a markdown report of them."""

    part: list[Literal["check", "train", "decode", "long", "all"]] = field(default_factory=lambda: ["all"])
    """Which parts, in this order: check, train, decode, long or all."""
    out: str = "bench-report.jsonl"
    """The JSON-lines file of finished jobs (appended to; jobs already in it are skipped). The markdown report
    goes beside it (.md), work files and each job's log into its -work folder."""
    only: list[str] = field(default_factory=list)
    """Run only the jobs whose names match one of these patterns (say 'train/rope' or 'decode/*')."""
    budget: float = 540
    """Seconds this command may run: a job still running then is stopped and not recorded (run the command again
    to go on). The default leaves room in a 10-minute limit."""
    peer: str = str(DEFAULT_PEER)
    """nanoGPT's directory, for its row beside ours (absent: the row says so)."""
    render: str | None = None
    """Only write the markdown report of this JSON-lines file (to FILE.md) and print it; run nothing."""

    def __post_init__(self) -> None:
        if self.budget <= 0:
            raise ConfigError(f"--budget must be positive, got {self.budget}.")
        if self.render is not None and not Path(self.render).is_file():
            raise ConfigError(f"--render {self.render}: no such file; pass the --out file of an earlier run.")


@dataclass(frozen=True)
class Job:
    """One run of a command: `python -m MODULE ARGV` in a process of its own, stopped after `limit` s."""

    name: str
    module: str
    argv: list[str]
    limit: float
    rows: str | None = None
    """The JSON-lines file where the command puts its rows (its --json), read into the job's line."""


def plan(cfg: ReportConfig, gpu: bool, work: Path) -> list[Job]:
    """Every job of the chosen parts, in order, shrunk on a CPU (the tiny model, eager, few steps)."""
    parts = PARTS if "all" in cfg.part else [p for p in PARTS if p in cfg.part]
    jobs = [job for part in parts for job in PLANS[part](gpu, work, cfg)]
    if cfg.only:
        jobs = [job for job in jobs if any(fnmatch.fnmatch(job.name, pattern) for pattern in cfg.only)]
    return jobs


def check_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    pytest = ["-v", "-m", "gpu", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_gpu.py")]
    if gpu and _has("xdist"):
        pytest += ["-n", str(min(12, os.cpu_count() or 1))]
    if _has("pytest_timeout"):
        pytest += ["--timeout", "240"]  # a test that hangs fails alone; the job goes on
    check = ["check", "--json", str(work / "check.json"), *([] if gpu else ["--quick", "true"])]
    return [Job("check/pytest-gpu", "pytest", pytest, 360 if gpu else 120),
            Job("check/kernels", "posgpt", check, 240 if gpu else 120, rows=check[2])]  # fmt: skip


def bench_gpu(gpu: bool, work: Path, name: str, *argv: str) -> list[str]:
    """`bench.py gpu` arguments, on a CPU its shrunk mode."""
    shrunk = [] if gpu else ["--compile", "false", "--steps", "2", "--warmup", "1"]
    return ["bench", "gpu", *argv, *shrunk, "--json", str(work / f"{name.replace('/', '-')}.jsonl")]


def train_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    shape = ["--shapes", "16x1024" if gpu else "4x64"]
    jobs = []
    for scheme in SCHEMES:
        name = f"train/{scheme}"
        extra = ["--trainer", "rope", "--peer", cfg.peer] if scheme == "rope" else ["--trainer", "[]", "--peer", "none"]
        argv = bench_gpu(gpu, work, name, "--schemes", scheme, *shape, *extra)
        jobs.append(Job(name, "posgpt", argv, 240 if scheme == "rope" else 150, rows=argv[-1]))
    argv = bench_gpu(gpu, work, "train/fp8", "--schemes", "rope", *shape, "--fp8", "true", "--trainer", "[]",
                     "--peer", "none")  # fmt: skip
    jobs.append(Job("train/fp8", "posgpt", argv, 150, rows=argv[-1]))
    fsdp = ["-q", "-p", "no:cacheprovider", "-m", "gpu", "-k", "fsdp", str(ROOT / "tests" / "test_gpu.py")]
    return [*jobs, Job("train/fsdp-resume", "pytest", fsdp, 150)]


def decode_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    jobs = []
    for scheme in DECODE_SCHEMES:
        for mode in ("eager", "compiled") if gpu else ("eager",):
            name = f"decode/{scheme}-{mode}"
            rows = str(work / f"{name.replace('/', '-')}.jsonl")
            shrunk = [] if gpu else ["--shape", "tiny", "--tokens", "8"]
            argv = ["bench", "decode", "--schemes", scheme, "--modes", mode, "--batches", "1", "64", "--peer", "none",
                    *shrunk, "--json", rows]  # fmt: skip
            jobs.append(Job(name, "posgpt", argv, 180, rows=rows))
    return jobs


def long_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    lengths = ["16384", "32768"] if gpu else ["128", "256"]
    jobs = []
    for scheme in SCHEMES:
        name = f"long/{scheme}"
        argv = bench_gpu(gpu, work, name, "--schemes", scheme, "--shapes", *(f"1x{n}" for n in lengths),
                         "--steps", "1", "--warmup", "1", "--trainer", "[]", "--peer", "none")  # fmt: skip
        jobs.append(Job(name, "posgpt", argv, 240, rows=argv[-1]))
    shape = ["12", "12", "768", "1024"] if gpu else ["2", "2", "32", "64"]
    fields = dict(zip(["n_layer", "n_head", "n_embd", "block_size"], shape, strict=True))
    checkpoints = []
    for scheme in LONG_EVAL:
        run = ["train", "--data.input", str(python_docs_path()), "--data.prepared_root", str(work / "prepared"),
               "--model.pos_encoding", scheme, *(a for k, v in fields.items() for a in (f"--model.{k}", v)),
               "--train.max_steps", "2", "--train.batch_size", "4", "--train.out_dir", str(work / "runs"),
               "--train.run_name", scheme, "--train.sample_tokens", "0",
               "--train.progress_bar", "false", "--train.logger", "csv"]  # fmt: skip
        jobs.append(Job(f"long/checkpoint-{scheme}", "posgpt", run, 300))
        checkpoints.append(str(work / "runs" / scheme / "last.ckpt"))
    evaluate = ["evaluate", "--ckpt", *checkpoints, "--labels", *LONG_EVAL, "--out", str(work / "eval"),
                "--eval.lengths", *lengths, "--eval.progress", "false"]  # fmt: skip
    return [*jobs, Job("long/evaluate", "posgpt", evaluate, 300)]


PLANS = {"check": check_jobs, "train": train_jobs, "decode": decode_jobs, "long": long_jobs}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_job(job: Job, limit: float, work: Path) -> dict[str, Any] | None:
    """Run `job` for at most `limit` seconds: its line for --out, or None where the budget (not the
    job's own limit) stopped it, so that the next run does it again."""
    work.mkdir(parents=True, exist_ok=True)
    stem = job.name.replace("/", "-")
    measure, log = work / f"{stem}.measure.json", work / f"{stem}.log"
    for stale in (measure, *([Path(job.rows)] if job.rows else [])):
        stale.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "benchmarks.measure", str(measure), job.module, *job.argv]
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            rc: int | None = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # pytest's workers and Inductor's compilers with it
            process.wait()
            rc = None
    wall = time.perf_counter() - started
    if rc is None and limit < job.limit:
        return None
    measured = json.loads(measure.read_text()) if measure.is_file() else {}
    lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    tail = lines[-20:]
    entry: dict[str, Any] = {"job": job.name, "status": status(rc, tail), "wall_s": round(wall, 1),
                             "limit_s": job.limit, "peak_mib": measured.get("peak_mib"), "log": log.name,
                             "command": " ".join(["python -m", job.module, *job.argv])}  # fmt: skip
    if rc != 0:
        entry["tail"] = tail[-8:]
    if job.rows and Path(job.rows).is_file():
        text = Path(job.rows).read_text()
        entry["rows"] = [json.loads(text)] if job.rows.endswith(".json") else [json.loads(x) for x in text.splitlines()]
    if job.module == "pytest":
        entry["summary"] = next((line.strip("= ") for line in reversed(tail) if " in " in line), "")
        entry["failures"] = failures(lines)
    return entry


def failures(lines: list[str]) -> list[str]:
    """Each failed test of a pytest log once, as 'FAILED test-id', whether pytest -v printed it before its
    outcome (one process), after it (xdist's workers) or in the closing summary."""
    found = []
    for line in lines:
        match = re.search(r"\b(FAILED|ERROR) (\S+::\S+)|(\S+::\S+) (FAILED|ERROR)\b", line)
        if match:
            outcome, test = (match[1], match[2]) if match[1] else (match[4], match[3])
            found.append(f"{outcome} {test}")
    return list(dict.fromkeys(found))


def status(rc: int | None, tail: list[str]) -> str:
    """ok; refused: the command's one-line reason (exit 2 with `error: ...`); out of time; failed."""
    if rc is None:
        return "out of time"
    if rc == 0:
        return "ok"
    reason = next((line.removeprefix("error: ") for line in reversed(tail) if line.startswith("error: ")), None)
    if rc == 2 and reason:
        return f"refused: {reason}"
    if any("OutOfMemoryError" in line for line in tail):
        return "out of memory"
    return f"failed (exit {rc})"


def environment() -> dict[str, Any]:
    """What every line records of the machine."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"date": time.strftime("%Y-%m-%d"), "device": device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda}  # fmt: skip


def done_jobs(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    return {json.loads(line)["job"] for line in path.read_text().splitlines() if line.strip()}


def write_report(path: Path) -> None:
    """Render `path` to `path`.md and print it."""
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    text = render(entries)
    atomic_write_bytes(path.with_suffix(".md"), text.encode())
    print(text)
    print(f"wrote {path.with_suffix('.md')}")


def report(cfg: ReportConfig) -> None:
    if cfg.render is not None:
        write_report(Path(cfg.render))
        return
    started = time.perf_counter()
    out = Path(cfg.out)
    work = out.resolve().with_name(out.stem + "-work")
    gpu = torch.cuda.is_available()
    jobs = plan(cfg, gpu, work)
    done = done_jobs(out)
    todo = [job for job in jobs if job.name not in done]
    print(f"{len(jobs)} jobs, {len(jobs) - len(todo)} already in {out}; logs in {work}", flush=True)
    machine = environment()
    for index, job in enumerate(todo):
        left = cfg.budget - (time.perf_counter() - started)
        entry = run_job(job, min(job.limit, left), work) if left > 0 else None
        if entry is None:
            print(f"stopped by --budget {cfg.budget:g} s with {len(todo) - index} jobs to go: run the same command "
                  "again to go on")  # fmt: skip
            break
        with open(out, "a", encoding="utf-8") as file:
            file.write(json.dumps({**entry, **machine}) + "\n")
        print(f"{job.name}: {entry['status']} ({entry['wall_s']:.0f} s)", flush=True)
    if out.is_file():
        write_report(out)


REPORT = Command("bench.py report", ReportConfig, report, ReportConfig.__doc__, logs=False)
