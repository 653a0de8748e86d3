"""The markdown of `bench.py report` (benchmarks/report.py): the machine, what each job did, each
part's table, and each measured ratio beside its target (issue 36's), from the lines of --out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from benchmarks import decoding, gpu
from benchmarks.gpu_rows import Row as TrainRow

TARGETS = {"mfu": 0.45, "vs_nanogpt": 1.15, "vs_rope": 0.95, "decode_b1_compiled": 2000, "decode_b1_eager": 200,
           "decode_b64_compiled": 30000}  # fmt: skip
"""What a 124M model should do on an H100: MFU of RoPE's compiled bf16 step at 16 x 1024 (dense bf16
peak), its tokens/s over nanoGPT's, each scheme's over RoPE's, decoding tokens/s at batch 1 and 64."""


def _rows(entries: list[dict[str, Any]], prefix: str) -> Iterable[tuple[str, dict[str, Any]]]:
    for entry in entries:
        if entry["job"].startswith(prefix):
            yield from ((entry["job"], row) for row in entry.get("rows", []))


def _build(kind: type, row: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    return kind(**{k: v for k, v in row.items() if k in names})


def _judge(value: float, target: float) -> str:
    return f"{value:,.2f} (target >= {target:,.2f}: {'met' if value >= target else 'missed'})"


def jobs_table(entries: list[dict[str, Any]]) -> list[str]:
    lines = ["| job | status | wall s | peak GiB (process) |", "|---|---|---:|---:|"]
    for e in entries:
        peak = "-" if e.get("peak_mib") is None else f"{e['peak_mib'] / 1024:.2f}"
        lines.append(f"| {e['job']} | {e['status']} | {e['wall_s']:.0f} | {peak} |")
    return lines


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
    rows = [(job, _build(TrainRow, row)) for job, row in _rows(entries, "train/")]
    if not rows:
        return []
    plain = [row for job, row in rows if job != "train/fp8"]
    lines = ["| " + " | ".join(gpu.HEAD) + " |", "|" + "---|" * len(gpu.HEAD)]
    lines += [gpu.row_line(dataclasses.replace(row, model="posgpt fp8") if job == "train/fp8" else row)
              for job, row in rows]  # fmt: skip
    lines += ["", *(f"- {line}" for line in gpu.ratios(plain))]
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
    rows = [_build(decoding.Row, row) for _, row in _rows(entries, "decode/")]
    if not rows:
        return []
    lines = [*decoding.summary(rows, sorted({r.batch for r in rows})), ""]
    for r in rows:
        key = f"decode_b{r.batch}_{r.mode}"
        if key in TARGETS:
            lines.append(f"- {r.scheme} {r.mode} batch {r.batch}: {_judge(r.tokens_per_s, TARGETS[key])} tokens/s")
    return lines


def long_lines(entries: list[dict[str, Any]]) -> list[str]:
    rows = [_build(TrainRow, row) for _, row in _rows(entries, "long/")]
    lines = ["| scheme | kernel | B x T | ms/step | peak GiB | compile s | note |", "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        ms = "-" if r.ms_per_step is None else f"{r.ms_per_step:,.0f}"
        peak = "-" if r.peak_mib is None else f"{r.peak_mib / 1024:.2f}"
        compile_s = "-" if r.compile_s is None else f"{r.compile_s:.0f}"
        lines.append(f"| {r.scheme} | {r.kernel} | {r.batch} x {r.context} | {ms} | {peak} | {compile_s} | {r.note} |")
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
    """The report: machine, jobs, then each part that has lines."""
    if not entries:
        return "# posgpt bench report\n\nNo job has finished yet.\n"
    first = entries[0]
    dates = sorted({e["date"] for e in entries})
    head = [f"# posgpt bench report: {first['device']}", "",
            f"torch {first['torch']}, CUDA {first['cuda'] or '-'}; {dates[0]}"
            f"{' to ' + dates[-1] if len(dates) > 1 else ''}; {len(entries)} jobs.", ""]  # fmt: skip
    parts = [("Checks", check_lines(entries)), ("Training (bench.py gpu)", train_lines(entries)),
             ("Decoding (bench.py decode)", decode_lines(entries)), ("Long context", long_lines(entries))]  # fmt: skip
    body = [line for title, lines in parts if lines for line in (f"## {title}", "", *lines, "")]
    return "\n".join([*head, "## Jobs", "", *jobs_table(entries), "", *body])
