"""`python bench.py report`: a job per process with its own limit, its line written when it ends (ok,
refused with the command's reason, out of time), jobs already in the file skipped, the budget leaving
a job for the next run, and the markdown rendered from the rows `bench.py gpu` and `bench.py decode`
write (their CPU modes run in test_bench_gpu.py and test_bench.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import posgpt.benchmarks.report as report
from posgpt.benchmarks.gpu import SCHEMES, Row
from posgpt.benchmarks.report import Job, ReportConfig, plan, render, run_job
from posgpt.core.modes import run_modes

QUICK = Job("quick/platform", "platform", [], 60)  # `python -m platform`: prints this machine, exits 0
SLOW = Job("slow/sleep", "timeit", ["-n", "1", "import time; time.sleep(60)"], 60)


def test_a_job_runs_in_its_own_process_and_its_status_is_recorded(tmp_path):
    entry = run_job(QUICK, 60, tmp_path)
    assert entry is not None and entry["status"] == "ok" and entry["peak_mib"] is None
    assert (tmp_path / entry["log"]).read_text().strip()  # the command's output, kept
    missing = tmp_path / "no-run"  # `posgpt plot` refuses it before it imports torch
    refused = run_job(Job("refused", "posgpt", ["plot", "--run_dir", str(missing)], 60), 60, tmp_path)
    reason = f"--run_dir {missing}: no such directory. Pass a run directory such as runs/NAME."
    assert refused is not None and refused["status"] == f"refused: {reason}", refused
    assert "\n" not in refused["status"]


def test_a_job_past_its_limit_is_out_of_time_and_one_stopped_by_the_budget_is_left_for_the_next_run(tmp_path):
    timed_out = run_job(dataclasses.replace(SLOW, limit=1), 1, tmp_path)
    assert timed_out is not None and timed_out["status"] == "out of time" and timed_out["wall_s"] < 30
    assert run_job(SLOW, 1, tmp_path) is None  # its own limit is 60 s: the budget stopped it


def test_a_second_run_skips_the_jobs_already_in_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "plan", lambda cfg, gpu, work: [QUICK])
    out = tmp_path / "r.jsonl"
    for _ in range(2):
        run_modes("bench.py", "", {"report": report.COMMAND}, ["report", "--out", str(out)])
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["job"] == "quick/platform"
    printed = capsys.readouterr().out
    assert "1 jobs, 1 already in" in printed and out.with_suffix(".md").read_text().startswith("# posgpt bench report")


def test_the_plan_has_every_scheme_in_train_and_long_and_each_part_by_name(tmp_path):
    names = [job.name for job in plan(ReportConfig(), True, tmp_path)]
    assert names[:2] == ["check/pytest-gpu", "check/kernels"]
    for scheme in SCHEMES:
        assert f"train/{scheme}" in names and f"long/{scheme}" in names
    assert {"train/fp8", "train/fsdp2", "train/fsdp-resume", "decode/rope-compiled", "long/evaluate"} <= set(names)
    only = plan(ReportConfig(part=["decode"], only=["decode/rope-*"]), True, tmp_path)
    assert [job.name for job in only] == ["decode/rope-eager", "decode/rope-compiled"]


def _entry(job: str, rows: list, **extra) -> dict:
    machine = {"date": "2026-11-26", "device": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0"}
    return {"job": job, "status": "ok", "wall_s": 40.0, "peak_mib": 2048.0, "rows": rows, **machine, **extra}


def test_the_report_puts_each_measured_ratio_beside_its_target():
    def train(model: str, scheme: str, speed: float, mfu: float | None = None) -> dict:
        return dataclasses.asdict(Row(model, scheme, "sdpa", 16, 1024, 34.0, speed, mfu, 12000.0, 20.0))

    decode = {"model": "posgpt", "scheme": "rope", "mode": "compiled", "batch": 1, "tokens_per_s": 2100.0,
              "first_token_ms": 9.0, "compile_s": 30.0, "peak_mib": 300.0, "graphs": 2}  # fmt: skip
    long = dataclasses.asdict(Row("posgpt", "t5", "flex", 1, 32768, None, None, None, None, None, "out of memory"))
    check = {"summary": "70 passed, 1 failed", "cases": [{"case": "softmax/t5/flex", "check": "bf16", "error": 0.2,
                                                          "tolerance": 0.05, "passed": False}]}  # fmt: skip
    entries = [_entry("check/kernels", [check]),
               _entry("check/pytest-gpu", [], status="failed (exit 1)", summary="60 passed, 2 failed in 200s",
                      failures=["FAILED tests/test_gpu.py::test_x"]),
               _entry("train/rope", [train("posgpt", "rope", 471000.0, 0.407), train("nanoGPT", "learned", 497000.0)]),
               _entry("train/alibi", [train("posgpt", "alibi", 411000.0)]),
               _entry("decode/rope-compiled", [decode]), _entry("long/t5", [long])]  # fmt: skip
    text = render(entries)
    assert text.startswith("# posgpt bench report: NVIDIA H100\n\ntorch 2.11.0, CUDA 13.0; 2026-11-26; 6 jobs.")
    assert "- RoPE MFU: 0.41 (target >= 0.45: missed)" in text
    assert "- RoPE / nanoGPT tokens/s: 0.95 (target >= 1.15: missed)" in text
    assert "- schemes under 0.95 of RoPE's tokens/s: alibi 0.87" in text
    assert "- rope compiled batch 1: 2,100.00 (target >= 2,000.00: met) tokens/s" in text
    assert "  - failed: softmax/t5/flex bf16 (error 0.2, tolerance 0.05)" in text
    assert "  - FAILED tests/test_gpu.py::test_x" in text and "- pytest -m gpu: 60 passed, 2 failed" in text
    assert "| t5 | flex | 1 x 32768 | - | - | - | out of memory |" in text
    assert "not: t5" in text


REFUSED = [(["--budget", "0"], "--budget must be positive"),
           (["--render", "missing.jsonl"], "--render missing.jsonl: no such file")]  # fmt: skip


@pytest.mark.parametrize(("argv", "needle"), REFUSED)
def test_report_refuses_a_bad_option_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as stop:
        run_modes("bench.py", "", {"report": report.COMMAND}, ["report", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and needle in err[0], err


def test_failed_tests_are_read_from_a_pytest_log_in_either_order_and_once():
    log = ["[gw1] [ 83%] FAILED tests/test_gpu.py::test_a[t5] ", "tests/test_gpu.py::test_b PASSED    [ 50%]",
           "tests/test_gpu.py::test_c ERROR    [ 60%]",
           "FAILED tests/test_gpu.py::test_a[t5] - AssertionError: x"]  # fmt: skip
    assert report.failures(log) == ["FAILED tests/test_gpu.py::test_a[t5]", "ERROR tests/test_gpu.py::test_c"]
