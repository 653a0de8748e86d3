"""`python bench.py decode` at the tiny shape, eager only (compiling with Inductor takes minutes on a
CPU): the live rows, the summary table and the JSON rows it appends, with nanoGPT's rows where the
peer is present and a note where it is not."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch

import bench
from posgpt.benchmarks import decoding
from posgpt.benchmarks.common import DEFAULT_PEER, SEED
from posgpt.benchmarks.decoding import SHAPES
from posgpt.core.modes import run_modes
from posgpt.model import GPT, GPTConfig

TINY = ["decode", "--shape", "tiny", "--batches", "1", "2", "--tokens", "8", "--modes", "eager"]


def _decode(argv: list[str], capsys) -> list[str]:
    run_modes("bench.py", bench.__doc__, bench.MODES, argv)
    return capsys.readouterr().out.splitlines()


def test_decode_prints_a_row_per_scheme_and_batch_and_appends_them_as_json(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"earlier": "command"}\n')  # appended to, never overwritten
    argv = [*TINY, "--schemes", "rope", "alibi", "--json", str(rows), "--peer", str(tmp_path / "none")]
    out = _decode(argv, capsys)
    assert any(line.startswith("note: no nanoGPT model.py in") for line in out), out
    live = [line.split(" | ") for line in out if line.startswith("| posgpt |")]
    assert [(r[1], r[3]) for r in live[:4]] == [("rope", "1"), ("rope", "2"), ("alibi", "1"), ("alibi", "2")]
    summary = out[out.index(next(line for line in out if line.startswith("Summary"))) + 1 :]
    assert summary[0].startswith("| model | scheme | mode | tokens/s b=1 | tokens/s b=2 | first token ms (b=1 / 2)")
    assert [line.split(" | ")[1] for line in summary[2:]] == ["rope", "alibi"]
    entries = [json.loads(line) for line in rows.read_text().splitlines()]
    assert entries[0] == {"earlier": "command"} and len(entries) == 5
    for entry, (scheme, batch) in zip(entries[1:], [("rope", 1), ("rope", 2), ("alibi", 1), ("alibi", 2)], strict=True):
        assert (entry["model"], entry["scheme"], entry["mode"], entry["batch"]) == ("posgpt", scheme, "eager", batch)
        assert entry["tokens_per_s"] > 0 and entry["first_token_ms"] > 0 and entry["compile_s"] is None
        assert (entry["n_layer"], entry["n_embd"], entry["new_tokens"], entry["dtype"]) == (2, 32, 8, "float32")
        assert entry["date"] and entry["device"] and entry["command"]


def test_decode_times_nanogpts_generate_on_the_same_shape(tmp_path, capsys):
    if not (DEFAULT_PEER / "model.py").is_file():
        pytest.skip(f"{DEFAULT_PEER} not present")
    rows = tmp_path / "rows.jsonl"
    out = _decode([*TINY, "--schemes", "learned", "--temperature", "0", "--json", str(rows)], capsys)
    nano = [json.loads(line) for line in rows.read_text().splitlines() if '"nanoGPT"' in line]
    assert [(e["scheme"], e["batch"]) for e in nano] == [("learned", 1), ("learned", 2)]
    assert all(e["tokens_per_s"] > 0 for e in nano)
    assert sum(line.startswith("| nanoGPT | learned | eager |") for line in out) == 3  # live rows 2, summary 1


def test_decode_times_hugging_faces_generate_on_the_weights_of_our_learned_row(tmp_path, capsys, monkeypatch):
    """Its rows beside ours, and the same weights: greedy, its tokens are our learned row's."""
    transformers = pytest.importorskip("transformers")
    made, generate = [], transformers.GPT2LMHeadModel.generate
    monkeypatch.setattr(
        transformers.GPT2LMHeadModel, "generate", lambda self, *a, **k: made.append(generate(self, *a, **k)) or made[-1]
    )
    out = _decode([*TINY, "--schemes", "learned", "--temperature", "0", "--peer", str(tmp_path)], capsys)
    assert sum(line.startswith("| Hugging Face | learned | eager |") for line in out) == 3  # live rows 2, summary 1
    torch.manual_seed(SEED)
    ours = GPT(GPTConfig(**SHAPES["tiny"], pos_encoding="learned", bias=False, dropout=0.0)).eval()
    prompt = made[-1][:1, :1]
    assert torch.equal(ours.generate(prompt, 8, temperature=0)[:, :9], made[-1][:1, :9])
    sampled = _decode([*TINY, "--schemes", "learned", "--batches", "1", "--peer", str(tmp_path)], capsys)
    assert sum(line.startswith("| Hugging Face | learned | eager |") for line in sampled) == 2


def test_without_transformers_the_hugging_face_rows_are_left_out_with_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(decoding, "find_spec", lambda name: None if name == "transformers" else find_spec(name))
    out = _decode([*TINY, "--schemes", "learned", "--batches", "1", "--peer", str(tmp_path)], capsys)
    assert "note: transformers is not installed: no Hugging Face rows (pip install transformers)" in out
    assert not any(line.startswith("| Hugging Face") for line in out)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--schemes", "ropee"], "no scheme 'ropee'"),
        (["--batches", "0"], "--batches must be at least 1"),
        (["--tokens", "0"], "--tokens must be at least 1"),
        (["--top_k", "-1"], "--top_k must be at least 0"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
    ],
)
def test_decode_refuses_a_bad_option_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        run_modes("bench.py", bench.__doc__, bench.MODES, ["decode", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and needle in err[0], err


def test_attention_cost_prints_each_functions_times_and_its_ratio_to_linear_attention(capsys):
    lines = _decode(["attention-cost", "--lengths", "64", "128", "--repeats", "1", "--heads", "2"], capsys)
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"function", "softmax", "linear", "gated_deltanet", "kda"}, lines
    assert rows["linear"].endswith("| 1.00 / 1.00 |") and all(float(c.replace(",", "")) > 0 for c in
                                                              rows["kda"].split(" | ")[1:3])  # fmt: skip


def test_attention_cost_refuses_an_unknown_function_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        run_modes("bench.py", bench.__doc__, bench.MODES, ["attention-cost", "--functions", "gdn"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "no scheme 'gdn'" in err[0], err
