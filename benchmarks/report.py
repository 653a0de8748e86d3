"""What a machine does with posgpt, in parts of about 8 minutes (`python bench.py report`; BENCHMARKS.md). Each
job is one run of an existing command in a process of its own, under its own time limit, and ends as one line of
`--out`; running a part again skips the jobs already there, so a part cut off by `--budget` loses nothing."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

import torch

from posgpt.benchmarks import decoding
from posgpt.benchmarks.common import DEFAULT_PEER, ROOT, cell, device_name, table_head, table_line
from posgpt.benchmarks.gpu import HEAD, SCHEMES, ratios, row_line
from posgpt.benchmarks.gpu import Row as TrainRow
from posgpt.core.cli import Command
from posgpt.core.errors import ConfigError
from posgpt.core.files import atomic_write_bytes
from posgpt.data.corpora import python_docs_path

DECODE_SCHEMES = ("learned", "rope", "alibi")
LONG_EVAL = ("rope", "alibi")


@dataclass
class ReportConfig:
    """What this machine does with posgpt: kernel checks, training, decoding and long-context speed,
    one job per process, each line of --out written as it finishes, and a markdown report of them."""

    part: list[Literal["check", "train", "decode", "long", "all"]] = field(default_factory=lambda: ["all"])
    """Which parts, in this order: check, train, decode, long or all."""
    out: str = "bench-report.jsonl"
    """The JSON-lines file of finished jobs (skipped when run again); the report goes beside it (.md), logs to -work."""
    only: list[str] = field(default_factory=list)
    """Run only the jobs whose names match one of these patterns (say 'train/rope' or 'decode/*')."""
    budget: float = 540
    """Seconds this command may run: a job still running then is stopped, left for the next run of the command."""
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
    jobs = [job for name, part in PARTS.items() if {name, "all"} & set(cfg.part) for job in part[1](gpu, work, cfg)]
    return [job for job in jobs if not cfg.only or any(fnmatch.fnmatch(job.name, pattern) for pattern in cfg.only)]


def check_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    pytest = ["-v", "-m", "gpu", "-p", "no:cacheprovider", str(ROOT / "tests")]  # every test marked gpu
    if gpu and find_spec("xdist"):
        pytest += ["-n", str(min(12, os.cpu_count() or 1))]
    if find_spec("pytest_timeout"):
        pytest += ["--timeout", "240"]  # a test that hangs fails alone; the job goes on
    check = ["check", "--json", str(work / "check.json"), *([] if gpu else ["--quick", "true"])]
    return [Job("check/pytest-gpu", "pytest", pytest, 360 if gpu else 120),
            Job("check/kernels", "posgpt", check, 240 if gpu else 120, rows=check[2])]  # fmt: skip


SHRUNK = {
    "gpu": ["--compile", "false", "--steps", "2", "--warmup", "1"],
    "decode": ["--shape", "tiny", "--tokens", "8"],
}
"""What a `bench.py MODE` job adds on a CPU: its shrunk mode."""


def bench_job(gpu: bool, work: Path, name: str, limit: float, mode: str, *argv: str, trainer: str = "[]",
              peer: str = "none") -> Job:  # fmt: skip
    """A `bench.py MODE` job, its rows in the work folder; the trainer's and nanoGPT's rows only where asked for."""
    rows = str(work / f"{name.replace('/', '-')}.jsonl")
    argv = (*argv, *(["--trainer", trainer] if mode == "gpu" else []), "--peer", peer, *([] if gpu else SHRUNK[mode]))
    return Job(name, "posgpt", ["bench", mode, *argv, "--json", rows], limit, rows)


def train_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    shape = ["--shapes", "16x1024" if gpu else "4x64"]
    rope = {"trainer": "rope", "peer": cfg.peer}  # the trainer's row and nanoGPT's beside RoPE's
    jobs = [bench_job(gpu, work, f"train/{s}", 240 if s == "rope" else 150, "gpu", "--schemes", s, *shape,
                      **(rope if s == "rope" else {})) for s in SCHEMES]  # fmt: skip
    jobs.append(bench_job(gpu, work, "train/fp8", 150, "gpu", "--schemes", "rope", *shape, "--fp8", "true"))
    jobs.append(bench_job(gpu, work, "train/fsdp2", 240, "gpu", "--schemes", "rope", *shape, "--strategy", "fsdp2",
                          trainer="rope"))  # fmt: skip
    fsdp = ["-q", "-p", "no:cacheprovider", "-m", "gpu", "-k", "fsdp", str(ROOT / "tests" / "test_gpu_runs.py")]
    return [*jobs, Job("train/fsdp-resume", "pytest", fsdp, 150)]


def decode_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    return [bench_job(gpu, work, f"decode/{scheme}-{mode}", 180, "decode", "--schemes", scheme, "--modes", mode,
                      "--batches", "1", "64")
            for scheme in DECODE_SCHEMES for mode in (("eager", "compiled") if gpu else ("eager",))]  # fmt: skip


def long_jobs(gpu: bool, work: Path, cfg: ReportConfig) -> list[Job]:
    lengths = ["16384", "32768"] if gpu else ["128", "256"]
    jobs = [bench_job(gpu, work, f"long/{scheme}", 240, "gpu", "--schemes", scheme, "--shapes",
                      *(f"1x{n}" for n in lengths), "--steps", "1", "--warmup", "1") for scheme in SCHEMES]  # fmt: skip
    shape = ["12", "12", "768", "1024"] if gpu else ["2", "2", "32", "64"]
    fields = dict(zip(["n_layer", "n_head", "n_embd", "block_size"], shape, strict=True))
    for scheme in LONG_EVAL:
        run = ["train", "--data.input", str(python_docs_path()), "--data.prepared_root", str(work / "prepared"),
               "--model.pos_encoding", scheme, *(a for k, v in fields.items() for a in (f"--model.{k}", v)),
               "--train.max_steps", "2", "--train.batch_size", "4", "--train.out_dir", str(work / "runs"),
               "--train.run_name", scheme, "--train.sample_tokens", "0",
               "--train.progress_bar", "false", "--train.logger", "csv"]  # fmt: skip
        jobs.append(Job(f"long/checkpoint-{scheme}", "posgpt", run, 300))
    checkpoints = [str(work / "runs" / scheme / "last.ckpt") for scheme in LONG_EVAL]
    evaluate = ["evaluate", "--ckpt", *checkpoints, "--labels", *LONG_EVAL, "--out", str(work / "eval"),
                "--eval.lengths", *lengths, "--eval.progress", "false"]  # fmt: skip
    return [*jobs, Job("long/evaluate", "posgpt", evaluate, 300)]


def run_job(job: Job, limit: float, work: Path) -> dict[str, Any] | None:
    """Run `job` for at most `limit` seconds: its line for --out, or None where the budget (not the
    job's own limit) stopped it, so that the next run does it again."""
    work.mkdir(parents=True, exist_ok=True)
    stem = job.name.replace("/", "-")
    measure, log = work / f"{stem}.measure.json", work / f"{stem}.log"
    for stale in (measure, *([Path(job.rows)] if job.rows else [])):
        stale.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "posgpt.benchmarks.measure", str(measure), job.module, *job.argv]
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
    matches = (re.search(r"\b(FAILED|ERROR) (\S+::\S+)|(\S+::\S+) (FAILED|ERROR)\b", line) for line in lines)
    return list(dict.fromkeys(f"{m[1] or m[4]} {m[2] or m[3]}" for m in matches if m))


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


TARGETS = {"mfu": 0.45, "vs_nanogpt": 1.15, "vs_rope": 0.95, "decode_b1_compiled": 2000, "decode_b1_eager": 200,
           "decode_b64_compiled": 30000}  # fmt: skip
"""What a 124M model should do on an H100: MFU of RoPE's compiled bf16 step at 16 x 1024 (dense bf16
peak), its tokens/s over nanoGPT's, each scheme's over RoPE's, decoding tokens/s at batch 1 and 64."""


def _rows(entries: list[dict[str, Any]], prefix: str, kind: type) -> list[tuple[str, Any]]:
    """(job, row as `kind`) of each row of the jobs whose names start with `prefix`."""
    names = {f.name for f in dataclasses.fields(kind)}
    return [(e["job"], kind(**{k: v for k, v in row.items() if k in names}))
            for e in entries if e["job"].startswith(prefix) for row in e.get("rows", [])]  # fmt: skip


def _judge(value: float, target: float) -> str:
    return f"{value:,.2f} (target >= {target:,.2f}: {'met' if value >= target else 'missed'})"


def check_lines(entries: list[dict[str, Any]]) -> list[str]:
    lines = []
    for e in entries:
        if e["job"] == "check/kernels" and e.get("rows"):
            payload = e["rows"][0]
            lines.append(f"- posgpt check: {payload['summary']}")
            lines += [f"  - failed: {c['case']} {c['check']} (error {c['error']:.3g}, tolerance {c['tolerance']:.3g})"
                      for c in payload["cases"] if c.get("passed") is False]  # fmt: skip
        elif e["job"] == "check/pytest-gpu":
            lines.append(f"- pytest -m gpu: {e.get('summary') or e['status']}")
            lines += [f"  - {line}" for line in e.get("failures", [])]
    return lines


def train_lines(entries: list[dict[str, Any]]) -> list[str]:
    rows = _rows(entries, "train/", TrainRow)
    if not rows:
        return []
    plain = [row for job, row in rows if job != "train/fp8"]
    lines = table_head(HEAD)
    lines += [row_line(dataclasses.replace(row, model="posgpt fp8") if job == "train/fp8" else row)
              for job, row in rows]  # fmt: skip
    lines += ["", *(f"- {line}" for line in ratios(plain))]
    speed = {(r.model, r.scheme): r for r in plain if r.tokens_per_s}
    rope, nano = speed.get(("posgpt", "rope")), speed.get(("nanoGPT", "learned"))
    if rope and rope.mfu is not None:
        lines.append(f"- RoPE MFU: {_judge(rope.mfu, TARGETS['mfu'])}")
    if rope and nano:
        ratio = rope.tokens_per_s / nano.tokens_per_s
        lines.append(f"- RoPE / nanoGPT tokens/s: {_judge(ratio, TARGETS['vs_nanogpt'])}")
    if rope:
        share = {s: r.tokens_per_s / rope.tokens_per_s for (m, s), r in speed.items() if m == "posgpt" and s != "rope"}
        slow = [f"{s} {x:.2f}" for s, x in share.items() if x < TARGETS["vs_rope"]]
        lines.append(f"- schemes under {TARGETS['vs_rope']} of RoPE's tokens/s: {', '.join(slow) or 'none'}")
    return lines


def decode_lines(entries: list[dict[str, Any]]) -> list[str]:
    rows = [row for _, row in _rows(entries, "decode/", decoding.Row)]
    if not rows:
        return []
    lines = [*decoding.summary(rows, sorted({r.batch for r in rows})), ""]
    for r in rows:
        key = f"decode_b{r.batch}_{r.mode}"
        if key in TARGETS:
            lines.append(f"- {r.scheme} {r.mode} batch {r.batch}: {_judge(r.tokens_per_s, TARGETS[key])} tokens/s")
    return lines


def long_lines(entries: list[dict[str, Any]]) -> list[str]:
    rows = [row for _, row in _rows(entries, "long/", TrainRow)]
    lines = ["| scheme | kernel | B x T | ms/step | peak GiB | compile s | note |", "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(table_line([r.scheme, r.kernel, f"{r.batch} x {r.context}", cell(r.ms_per_step, ",.0f"),
                                 cell(r.peak_mib, ".2f", 1 / 1024), cell(r.compile_s, ".0f"), r.note]))  # fmt: skip
    if rows:
        longest = max(r.context for r in rows)
        at_longest = [r for r in rows if r.context == longest]
        failed = [r.scheme for r in at_longest if r.note or r.ms_per_step is None]
        lines.append(f"\n- a compiled step at {longest} tokens: {len(at_longest) - len(failed)} schemes ran"
                     f"{'; not: ' + ', '.join(failed) if failed else ''}")  # fmt: skip
    for e in entries:
        if e["job"] == "long/evaluate":
            peak = "-" if e.get("peak_mib") is None else f"{e['peak_mib'] / 1024:.2f} GiB"
            lines.append(f"- evaluate.py (RoPE, ALiBi): {e['status']}, {e['wall_s']:.0f} s, peak {peak}")
    return lines if len(lines) > 2 else []


def render(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "# posgpt bench report\n\nNo job has finished yet.\n"
    first = entries[0]
    dates = sorted({e["date"] for e in entries})
    head = [f"# posgpt bench report: {first['device']}", "",
            f"torch {first['torch']}, CUDA {first['cuda'] or '-'}; {dates[0]}"
            f"{' to ' + dates[-1] if len(dates) > 1 else ''}; {len(entries)} jobs.", ""]  # fmt: skip
    jobs = [table_line([e["job"], e["status"], f"{e['wall_s']:.0f}", cell(e.get("peak_mib"), ".2f", 1 / 1024)])
            for e in entries]  # fmt: skip
    parts = [("Jobs", ["| job | status | wall s | peak GiB (process) |", "|---|---|---:|---:|", *jobs])]
    parts += [(title, lines(entries)) for title, _, lines in PARTS.values()]
    body = [line for title, lines in parts if lines for line in (f"## {title}", "", *lines, "")]
    return "\n".join([*head, *body])


PARTS = {
    "check": ("Checks", check_jobs, check_lines),
    "train": ("Training (bench.py gpu)", train_jobs, train_lines),
    "decode": ("Decoding (bench.py decode)", decode_jobs, decode_lines),
    "long": ("Long context", long_jobs, long_lines),
}
"""Each part of the report, in order: its title, its jobs and the lines it renders of their entries."""


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def write_report(path: Path) -> None:
    text = render(read_lines(path))
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
    done = {entry["job"] for entry in read_lines(out)}
    todo = [job for job in jobs if job.name not in done]
    print(f"{len(jobs)} jobs, {len(jobs) - len(todo)} already in {out}; logs in {work}", flush=True)
    device = torch.device("cuda" if gpu else "cpu")  # what every line records of the machine
    machine = {"date": time.strftime("%Y-%m-%d"), "device": device_name(device), "torch": torch.__version__,
               "cuda": torch.version.cuda}  # fmt: skip
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


COMMAND = Command("bench.py report", ReportConfig, report, ReportConfig.__doc__, logs=False)
