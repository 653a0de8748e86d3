"""`python bench.py gpu` in its CPU mode (the tiny model at 4 x 64, eager: compiling with Inductor
takes minutes on a CPU): a row per scheme, the trainer's row, nanoGPT's where the peer is present,
the ratios, the JSON rows appended, and one line for each option it refuses."""

from __future__ import annotations

import json

import pytest

import bench
from posgpt.benchmarks.common import DEFAULT_PEER
from posgpt.benchmarks.gpu import GPU_SHAPES, Row, ratios
from posgpt.benchmarks.report import render
from posgpt.core.modes import run_modes

CPU_MODE = ["gpu", "--device", "cpu", "--compile", "false", "--steps", "2", "--warmup", "1"]


def _bench(argv: list[str], capsys) -> list[str]:
    run_modes("bench.py", bench.__doc__, bench.MODES, argv)
    return capsys.readouterr().out.splitlines()


def _rows(out: list[str], model: str) -> list[list[str]]:
    return [line.split(" | ") for line in out if line.startswith(f"| {model} |")]


def test_cpu_mode_times_each_scheme_the_trainer_and_nanogpt_and_appends_json(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"earlier": "command"}\n')  # appended to, never overwritten
    peer = DEFAULT_PEER if (DEFAULT_PEER / "model.py").is_file() else tmp_path / "no-peer"
    argv = [*CPU_MODE, "--schemes", "rope", "alibi", "window", "--window", "16", "--json", str(rows)]
    argv += ["--peer", str(peer)]
    out = _bench(argv, capsys)
    ours = _rows(out, "posgpt")
    assert [(r[1], r[2], r[3]) for r in ours] == [("rope", "sdpa", "4 x 64"), ("alibi", "sdpa", "4 x 64"),
                                                  ("window", "sdpa", "4 x 64")]  # fmt: skip
    assert all(float(r[5].replace(",", "")) > 0 and r[6] == "-" for r in ours)  # tokens/s; no MFU on a CPU
    trainer = _rows(out, "lightning")
    assert len(trainer) == 1 and trainer[0][1] == "rope" and float(trainer[0][5].replace(",", "")) > 0
    entries = [json.loads(line) for line in rows.read_text().splitlines()]
    assert entries[0] == {"earlier": "command"}
    kinds = [(e["model"], e["scheme"]) for e in entries[1:]]
    expected = [("posgpt", "rope"), ("posgpt", "alibi"), ("posgpt", "window"), ("lightning", "rope")]
    if peer == DEFAULT_PEER:
        expected.append(("nanoGPT", "learned"))
        assert "rope/nanoGPT" in out[-1]
    else:
        assert any(line.startswith("note: no nanoGPT model.py in") for line in out), out
    assert kinds == expected
    for entry in entries[1:]:
        assert entry["note"] == "" and entry["tokens_per_s"] > 0 and entry["ms_per_step"] > 0
        assert (entry["batch"], entry["context"], entry["n_layer"], entry["precision"]) == (4, 64, 2, "32-true")
        assert entry["date"] and entry["device"] and entry["command"] and entry["torch"]
    assert out[-1].startswith("4 x 64: alibi/rope ") and ", window/rope " in out[-1]
    assert ", trainer/bare (rope) " in out[-1]
    job = {"job": "train/rope", "status": "ok", "wall_s": 1.0, "peak_mib": None, "rows": entries[1:],
           **{k: entries[1][k] for k in ("date", "device", "torch")}, "cuda": None}  # fmt: skip
    report = render([job])  # what `bench.py report` makes of these rows
    assert report.startswith(f"# posgpt bench report: {entries[1]['device']}") and "| posgpt | alibi | sdpa |" in report
    assert "- 4 x 64: alibi/rope " in report and "- schemes under 0.95 of RoPE's tokens/s:" in report


def test_ratios_put_each_scheme_beside_rope_the_trainer_beside_the_bare_step_and_ours_beside_nanogpt():
    def row(model: str, scheme: str, speed: float | None, note: str = "") -> Row:
        return Row(model, scheme, "sdpa", 16, 1024, tokens_per_s=speed, note=note)

    rows = [row("posgpt", "rope", 400.0), row("posgpt", "alibi", 380.0), row("posgpt", "t5", None, "out of memory"),
            row("lightning", "rope", 390.0), row("nanoGPT", "learned", 320.0),
            row("posgpt", "learned", 420.0)]  # fmt: skip
    (line,) = ratios(rows)
    assert line == (
        "16 x 1024: alibi/rope 0.95, trainer/bare (rope) 0.975, learned/rope 1.05, learned/nanoGPT 1.31, "
        "rope/nanoGPT 1.25"
    )


def test_a_failing_row_is_recorded_and_the_table_goes_on(tmp_path, capsys, monkeypatch):
    import posgpt.benchmarks.gpu as gpu

    real = gpu.run_step

    def fail_alibi(setup, row):
        if row.scheme == "alibi":
            raise torch_oom()
        return real(setup, row)

    monkeypatch.setattr(gpu, "run_step", fail_alibi)
    rows = tmp_path / "rows.jsonl"
    argv = [*CPU_MODE, "--schemes", "alibi", "rope", "--trainer", "[]", "--peer", "none", "--json", str(rows)]
    out = _bench(argv, capsys)
    ours = _rows(out, "posgpt")
    assert [(r[1], r[-1].rstrip(" |")) for r in ours] == [("alibi", "out of memory"), ("rope", "")]
    notes = [json.loads(line)["note"] for line in rows.read_text().splitlines()]
    assert notes == ["out of memory", ""]


def torch_oom() -> Exception:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_gpu_shapes_are_the_issues():
    assert GPU_SHAPES == ["16x1024", "32x1024", "4x4096", "1x16384", "1x32768"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--schemes", "ropee"], "no scheme 'ropee'"),
        (["--trainer", "alibii"], "no scheme 'alibii'"),
        (["--shapes", "16by1024"], "write each shape as BATCHxCONTEXT"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--sinks", "-1"], "--sinks must be at least 0"),
        (["--fp8", "true"], "--fp8 true needs an NVIDIA GPU with FP8 tensor cores"),
    ],
)
def test_gpu_bench_refuses_a_bad_option_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as stop:
        run_modes("bench.py", bench.__doc__, bench.MODES, ["gpu", "--device", "cpu", "--peer", "none", *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
