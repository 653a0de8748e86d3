"""evaluate.py and `evaluation.run` on checkpoints from tiny training runs: numbers against a
direct computation, RoPE scaling rows, the four output files, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.colors
import numpy as np
import pytest
from conftest import make_text

import evaluate as evaluate_script
from posgpt.core import cli
from posgpt.data.dataset import load_prepared
from posgpt.evaluation.attention_stats import log_edges
from posgpt.evaluation.checkpoint import EvalData, default_labels, load_checkpoint
from posgpt.evaluation.figures import line_style, stats_figure
from posgpt.evaluation.report import TRAIN_LENGTH_LINE, Group, position_figure
from posgpt.evaluation.run import EvalSettings, evaluate_checkpoints
from posgpt.model import GPTConfig
from posgpt.training.config import DataConfig, RunConfig, TrainConfig
from posgpt.training.run import train

from helpers import assert_png, cli_error, direct_loss, train_tiny

BLOCK = 16


def _train_tiny(tmp: Path, text: Path, scheme: str, name: str, seed: int = 1337) -> Path:
    return train_tiny(tmp, text, name, seed, block_size=BLOCK, pos_encoding=scheme)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """rope, learned and alibi checkpoints on one corpus, plus a rope one (`other`) on a corpus with
    more characters, i.e. another char tokenizer."""
    tmp = tmp_path_factory.mktemp("evaluate")
    text = tmp / "corpus.txt"
    text.write_text(make_text(1500))
    other = tmp / "other.txt"
    other.write_text(make_text(1500, seed=1) + "0123456789 ;:!?\n" * 50)
    ckpts = {scheme: _train_tiny(tmp, text, scheme, scheme) for scheme in ("rope", "learned", "alibi")}
    ckpts["rope_seed2"] = _train_tiny(tmp, text, "rope", "rope_seed2", seed=2)
    ckpts["other"] = _train_tiny(tmp, other, "rope", "other")
    ckpts["corpus"], ckpts["tmp"] = text, tmp
    return ckpts


def _evaluate(tmp: Path, *args: str) -> dict:
    out = tmp / "out"
    cli.run(evaluate_script.COMMAND, [*args, "--out", str(out), "--eval.progress", "false"])
    return json.loads((out / "results.json").read_text())


def _val_tokens(ckpt: Path) -> np.ndarray:
    cfg = load_checkpoint(ckpt).config["data"]
    prepared = next(Path(cfg["prepared_root"]).glob(Path(cfg["input"]).stem + "-*"))
    return np.asarray(load_prepared(prepared).tokens("val"))


@pytest.mark.parametrize(("mode", "stride"), [("nonoverlap", None), ("sliding", 8), ("sliding", 16)])
def test_numbers_equal_a_direct_computation(runs, tmp_path, mode, stride):
    args = ["--ckpt", str(runs["rope"]), str(runs["alibi"]), "--eval.lengths", "[16,48]", "--eval.token_budget", "240",
            "--eval.mode", mode]  # fmt: skip
    doc = _evaluate(tmp_path, *args, *(["--eval.stride", str(stride)] if stride else []))
    tokens = _val_tokens(runs["rope"])
    for run in doc["runs"]:
        model = load_checkpoint(run["checkpoint"]).model
        for row in run["results"]:
            s = stride or row["length"]
            expected = direct_loss(model, tokens, row["length"], s, budget=row["scored_tokens"])
            assert row["loss"] == pytest.approx(expected, rel=1e-5)
            assert row["ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
            assert row["mode"] == ("nonoverlap" if s == row["length"] else "sliding") and row["stride"] == s


@pytest.mark.plot
def test_output_files_and_not_applicable_rows(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(runs["tmp"])  # the checkpoints' data lies here: results.json names it from here
    lengths = [8, 16, 32, 64]
    doc = _evaluate(tmp_path, "--ckpt", str(runs["rope"]), str(runs["learned"]), "--eval.lengths", str(lengths),
                    "--eval.token_budget", "128")  # fmt: skip
    out = tmp_path / "out"
    for name in ("results.json", "results.md", "ppl_vs_length.png", "loss_by_position.png"):
        assert (out / name).stat().st_size > 0
    for name in ("ppl_vs_length.png", "loss_by_position.png"):
        assert_png(out / name)
    assert doc["settings"]["lengths"] == lengths and doc["settings"]["token_budget"] == 128
    assert [run["label"] for run in doc["runs"]] == ["rope", "learned"]
    for run in doc["runs"]:
        assert [row["length"] for row in run["results"]] == lengths
        assert run["config"]["model"]["pos_encoding"] == run["pos_encoding"] and run["train_length"] == BLOCK
        assert len(run["data"]["sha256"]) == 64 and run["data"]["tokens"] > 64
        assert run["data"]["source"].startswith("prepared/corpus-") and "own data" in run["data"]["source"]
    learned = {row["length"]: row for row in doc["runs"][1]["results"]}
    assert learned[16]["applicable"] and learned[16]["ppl"] > 1
    assert not learned[32]["applicable"] and learned[32]["ppl"] is None and "block_size=16" in learned[32]["reason"]
    assert all(row["scored_tokens"] == 128 for row in doc["runs"][0]["results"])
    table = (out / "results.md").read_text()
    params = f"{doc['runs'][0]['params']:,}"  # the model's parameter count beside its scheme
    assert f"| rope | rope | {params} | 16 | char" in table and "| n/a | n/a |" in table


def test_the_default_lengths_start_at_the_default_models_training_length():
    """Issue 57: they started at 128, past the default model's 64, where it is at its best."""
    assert EvalSettings().lengths[0] == RunConfig().model.block_size == 64


def test_rope_scaling_with_factor_one_changes_nothing(runs, tmp_path):
    doc = _evaluate(tmp_path, "--ckpt", str(runs["rope"]), str(runs["alibi"]), "--eval.lengths", "[16,64]",
                    "--eval.token_budget", "128", "--eval.rope_scaling", "[none,linear,ntk,yarn]",
                    "--eval.rope_scaling_factor", "1")  # fmt: skip
    labels = [run["label"] for run in doc["runs"]]
    assert labels == ["rope", "rope + linear", "rope + ntk", "rope + yarn", "alibi"]  # one row for alibi
    losses = [[row["loss"] for row in run["results"]] for run in doc["runs"][:4]]
    assert all(other == pytest.approx(losses[0], rel=1e-6) for other in losses[1:])
    assert all(row["rope_scaling_factor"] == 1.0 for run in doc["runs"][1:4] for row in run["results"])


def test_dynamic_rope_scaling_acts_beyond_the_training_length_only(runs, tmp_path):
    doc = _evaluate(tmp_path, "--ckpt", str(runs["rope"]), "--eval.lengths", "[16,64]", "--eval.token_budget", "128",
                    "--eval.rope_scaling", "[none,yarn]")  # fmt: skip
    plain, yarn = ({row["length"]: row for row in run["results"]} for run in doc["runs"])
    assert yarn[16]["loss"] == pytest.approx(plain[16]["loss"], rel=1e-6) and yarn[16]["rope_scaling_factor"] == 1
    assert yarn[64]["loss"] != pytest.approx(plain[64]["loss"], rel=1e-6)
    assert yarn[64]["rope_scaling"] == "yarn" and yarn[64]["rope_scaling_factor"] == 4.0
    assert plain[64]["rope_scaling"] == "none"
    assert "RoPE scaling factor" in (tmp_path / "out" / "results.md").read_text()


def test_rope_scaling_a_model_whose_kinds_turn_at_several_bases_is_said_in_one_line(runs, tmp_path, caplog):
    """Issue 57: on the Gemma 3 layout, --eval.rope_scaling ntk gave the as-trained row alone, and said nothing."""
    kinds = {"local": {"attn_window": 4, "rope_base": 100.0}, "global": {"rope_base": 1e6}}
    gemma = train_tiny(tmp_path, runs["corpus"], "gemma", pos_encoding="rope", layout=("local", "global"), kinds=kinds)
    doc = _evaluate(tmp_path, "--ckpt", str(gemma), str(runs["rope"]), "--eval.lengths", "[16]",
                    "--eval.token_budget", "64", "--eval.rope_scaling", "[none,ntk]")  # fmt: skip
    assert [run["label"] for run in doc["runs"]] == ["gemma", "rope", "rope + ntk"]
    assert "| gemma | rope, local-global | " in (tmp_path / "out" / "results.md").read_text()  # issue 57: "rope"
    said = [record.getMessage() for record in caplog.records if "gemma" in record.getMessage()]
    assert said == [
        "gemma: its kinds turn RoPE at bases 100, 1,000,000, which ntk does not stretch alike (Gemma 3 scales its "
        "global layers only): evaluated as trained"
    ]


@pytest.mark.plot  # the perplexity figure's error bars over seeds, rendered
def test_checkpoints_sharing_a_label_are_seeds(runs, tmp_path):
    _evaluate(tmp_path, "--ckpt", str(runs["rope"]), str(runs["rope_seed2"]), "--labels", "rope", "rope",
              "--eval.lengths", "[16,32]", "--eval.token_budget", "64")  # fmt: skip
    table = (tmp_path / "out" / "results.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| rope |"))
    assert "| 2 |" in row and row.count("±") == 2 and "mean ± standard deviation" in table
    assert_png(tmp_path / "out" / "ppl_vs_length.png")


def _scored_line(tmp: Path) -> str:
    report = (tmp / "out" / "results.md").read_text()
    return next(line for line in report.splitlines() if "scored" in line and "budget" in line)


def test_the_report_states_the_tokens_scored_not_the_budget(runs, tmp_path):
    """A budget past the validation split scores what the split holds, per length: the report says so
    (it used to say "100,000 tokens scored at every length"); a budget that is not a multiple of a
    length scores whole windows under it, and the text did not end there."""
    n = len(_val_tokens(runs["rope"]))
    doc = _evaluate(tmp_path, "--ckpt", str(runs["rope"]), "--eval.lengths", "[16,48]", "--eval.token_budget", "100000")
    scored = {row["length"]: row["scored_tokens"] for row in doc["runs"][0]["results"]}
    assert scored == {16: (n - 1) // 16 * 16, 48: (n - 1) // 48 * 48} and max(scored.values()) < 100_000
    assert _scored_line(tmp_path) == (
        f"- tokens scored, from the start of the text: {scored[16]:,} at 16; {scored[48]:,} at 48 "
        "(budget 100,000: the text ended first)"
    )
    _evaluate(tmp_path, "--ckpt", str(runs["rope"]), "--eval.lengths", "[16,48]", "--eval.token_budget", "100")
    assert _scored_line(tmp_path) == "- tokens scored, from the start of the text: 96 at every length (budget 100)"


def test_each_checkpoint_tokenizes_a_given_text_with_its_own_tokenizer(runs, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text(make_text(300, seed=5))  # characters both vocabularies have
    doc = _evaluate(tmp_path, "--ckpt", str(runs["rope"]), str(runs["other"]), "--eval.lengths", "[16,32]",
                    "--eval.token_budget", "64", "--eval_data.input", str(text))  # fmt: skip
    first, second = doc["runs"]
    assert first["tokenizer"] != second["tokenizer"] and first["data"]["sha256"] != second["data"]["sha256"]
    assert first["data"]["text_sha256"] == second["data"]["text_sha256"]
    for run in doc["runs"]:  # the numbers are the model's on its own tokenization of the text
        ckpt = load_checkpoint(run["checkpoint"])
        tokens = np.array(ckpt.tokenizer.encode(text.read_text()), dtype=np.int64)
        assert run["results"][0]["loss"] == pytest.approx(direct_loss(ckpt.model, tokens, 16, 16, 64), rel=1e-5)
    table = (tmp_path / "out" / "results.md").read_text()
    assert "tokenizers differ" in table and first["tokenizer"] in table and second["tokenizer"] in table


def _fails(capsys, *args: str) -> str:
    return cli_error(capsys, evaluate_script.COMMAND, [*args, "--eval.progress", "false"])


def test_bad_input_fails_with_one_clear_message(runs, tmp_path, capsys):
    rope = str(runs["rope"])
    short = tmp_path / "short.txt"
    short.write_text("the king speaks of the sea.\n")
    out = ["--out", str(tmp_path / "out")]
    assert "too few for one window at length 64" in _fails(capsys, "--ckpt", rope, "--eval.lengths", "[16,64]",
                                                            "--eval_data.input", str(short), *out)  # fmt: skip
    assert "Checkpoint not found: nope.ckpt" in _fails(capsys, "--ckpt", rope, "nope.ckpt", *out)
    unknown = _fails(capsys, "--ckpt", rope, "--eval_data.input", str(runs["tmp"] / "other.txt"), *out)
    assert "outside the vocabulary" in unknown and "--eval_data.drop_unknown true" in unknown
    prepared_other = next((runs["tmp"] / "prepared").glob("other-*"))
    assert "was tokenized with char" in _fails(capsys, "--ckpt", rope, "--eval_data.dir", str(prepared_other), *out)
    assert "--eval.mode sliding" in _fails(capsys, "--ckpt", rope, "--eval.stride", "8", *out)
    assert "needs --eval.stride" in _fails(capsys, "--ckpt", rope, "--eval.mode", "sliding", *out)
    assert "smallest length" in _fails(capsys, "--ckpt", rope, "--eval.mode", "sliding", "--eval.stride", "32",
                                       "--eval.lengths", "[16,64]", *out)  # fmt: skip
    assert "rope_scaling_factor must be >= 1" in _fails(
        capsys, "--ckpt", rope, "--eval.rope_scaling_factor", "0.5", *out
    )
    assert "2 names for 1 checkpoints" in _fails(capsys, "--ckpt", rope, "--labels", "a", "b", *out)
    assert not (tmp_path / "out").exists()  # nothing written by a run that failed its checks


def test_drop_unknown_leaves_out_unknown_characters(runs, tmp_path):
    other = str(runs["tmp"] / "other.txt")
    doc = _evaluate(tmp_path, "--ckpt", str(runs["rope"]), "--eval_data.input", other, "--eval_data.drop_unknown",
                    "true", "--eval.lengths", "[16]", "--eval.token_budget", "64")  # fmt: skip
    assert doc["runs"][0]["results"][0]["ppl"] > 1


def test_default_labels_name_the_run_directory():
    assert default_labels(["runs/a/last.ckpt", "runs/b/best.ckpt", "x/model.ckpt", "runs/a/best.ckpt"]) == [
        "a", "b", "model", "a#2",
    ]  # fmt: skip


def test_memory_is_bounded_by_batch_tokens(runs, monkeypatch):
    """A long length runs in batches of one window when batch_tokens is small (and gives the same loss)."""
    from posgpt.model import GPT

    batch_sizes: list[int] = []
    hidden_states = GPT.hidden_states

    def counting(self, idx, *args, **kwargs):
        batch_sizes.append(idx.size(0))
        return hidden_states(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "hidden_states", counting)
    paths, labels = [str(runs["alibi"])], ["alibi"]
    big = evaluate_checkpoints(paths, labels, EvalSettings(lengths=[64], token_budget=256, progress=False), EvalData())
    assert batch_sizes == [4]  # 256 tokens in windows of 64: one forward pass of 4 windows
    batch_sizes.clear()
    small = evaluate_checkpoints(
        paths, labels, EvalSettings(lengths=[64], token_budget=256, batch_tokens=64, progress=False), EvalData()
    )
    assert batch_sizes == [1, 1, 1, 1]  # batch_tokens = one window: one window per forward pass
    assert small["runs"][0]["results"][0]["loss"] == pytest.approx(big["runs"][0]["results"][0]["loss"], rel=1e-5)


def test_a_char_and_a_bpe_checkpoint_on_one_text(runs, tmp_path, gpt2_ranks):
    """Different kinds of tokenizer: each encodes the text itself; the table says so."""
    cfg = RunConfig(
        model=GPTConfig(block_size=BLOCK, n_layer=1, n_head=2, n_embd=16, bias=False, pos_encoding="alibi"),
        data=DataConfig(input=str(runs["corpus"]), tokenizer="gpt2", tiktoken_ranks=str(gpt2_ranks),
                        prepared_root=str(tmp_path / "prepared")),
        train=TrainConfig(max_steps=3, batch_size=4, eval_interval=3, out_dir=str(tmp_path / "runs"),
                          run_name="bpe", logger="none", progress_bar=False, sample_tokens=0),
    )  # fmt: skip
    bpe = train(cfg).last_ckpt
    text = tmp_path / "eval.txt"
    text.write_text(make_text(400, seed=7))
    doc = _evaluate(tmp_path, "--ckpt", str(runs["alibi"]), str(bpe), "--eval.lengths", "[16,32]",
                    "--eval.token_budget", "64", "--eval_data.input", str(text))  # fmt: skip
    char_run, bpe_run = doc["runs"]
    assert bpe_run["tokenizer"] == "gpt2 (50257)" and char_run["tokenizer"].startswith("char")
    assert bpe_run["data"]["tokens"] < char_run["data"]["tokens"] / 2  # BPE tokens span several characters
    assert "tokenizers differ (char" in (tmp_path / "out" / "results.md").read_text()


def test_bfloat16_autocast_on_cpu_stays_close_to_float32(runs, tmp_path):
    """The GPU default (bf16 autocast, float32 losses), run on the CPU's autocast."""
    args = ["--ckpt", str(runs["rope"]), str(runs["alibi"]), "--eval.lengths", "[16,48]", "--eval.token_budget", "240",
            "--eval.device", "cpu"]  # fmt: skip
    fp32 = _evaluate(tmp_path / "fp32", *args, "--eval.dtype", "float32")
    bf16 = _evaluate(tmp_path / "bf16", *args, "--eval.dtype", "bfloat16")
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    for run, ref in zip(bf16["runs"], fp32["runs"], strict=True):
        for row, ref_row in zip(run["results"], ref["results"], strict=True):
            assert row["loss"] == pytest.approx(ref_row["loss"], rel=2e-2) and row["loss"] != ref_row["loss"]


# the figures' legends and the training-length marker, on hand-made results

LONG_LABELS = {
    "wide": [f"WWWWWWWWWWWWWWWWWWWWWWWWWWWW MMMMMMMM {i}" for i in range(4)],  # wide letters, one column too wide
    "one_word": ["rope_yarn_" * 12 + str(i) for i in range(3)],  # no space to wrap at
    "many": [f"rope + yarn, attn_window 64, seed average {i}" for i in range(12)],
}


def _assert_legend_fits(fig, labels: list[str]) -> None:
    """The legend lies inside the figure as drawn (nothing clipped when saved), below every panel, and
    lists every label (wrapped, perhaps)."""
    fig.canvas.draw()
    (legend,) = fig.legends
    box, page = legend.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, (box, page)
    for ax in fig.axes:
        if ax.lines:  # the panel with its tick labels and axis label sits above the legend
            assert ax.get_tightbbox().y0 >= box.y1 - 1
    shown = {"".join(text.get_text().split()) for text in legend.get_texts()}
    assert {"".join(label.split()) for label in labels} <= shown


def _position_doc(labels: list[str], lengths=(64, 128)) -> tuple[dict, list[Group]]:
    runs = [{"label": label, "train_length": 32, "results": [{"length": n, "applicable": True,
             "bucket_starts": [0, n // 4, n // 2, 3 * n // 4], "by_position": [3.0 - 0.1 * i, 2.5, 2.4, 2.6]}
             for n in lengths]} for i, label in enumerate(labels)]  # fmt: skip
    return {"settings": {"lengths": list(lengths)}}, [Group(r["label"], [r]) for r in runs]


@pytest.mark.parametrize(
    ("labels", "lengths"),
    [("wide", (64,)), ("one_word", (64,)), ("many", (64,)), ("many", (64, 128, 256, 512))],
    ids=["wide", "one_word", "many", "many-four-panels"],
)
def test_the_loss_by_position_legend_lies_inside_the_figure(labels, lengths):
    """In one panel each kind of label takes its own way through `legend_below`: the figure widened to
    fit (wide), the labels wrapped (one_word), several columns (many); in four panels (a wider figure)
    every kind fits unwrapped, the many labels (the tallest legend) lie below every panel."""
    _assert_legend_fits(position_figure(*_position_doc(LONG_LABELS[labels], lengths)), LONG_LABELS[labels])


def _stats_entries(labels: list[str], length: int = 64) -> list[dict]:
    edges = log_edges(length)
    buckets = len(edges) - 1
    per_head = [[[0.5 / (b + 1) for b in range(buckets)]] * 2] * 2  # [layer][head][bucket]
    summary = {"sink_tokens": 4, "distance": {"edges": edges, "mean_weight": per_head},
               "position": {"edges": edges, "entropy": per_head, "sink_mass": per_head}}  # fmt: skip
    return [{"label": label, "train_length": 32, "length": length, "summary": summary} for label in labels]


def test_the_attention_figure_legend_lies_inside_the_figure():
    """Every kind of label at once: the figure is wide enough for each kind unwrapped."""
    labels = [label for kind in LONG_LABELS.values() for label in kind]
    _assert_legend_fits(stats_figure(_stats_entries(labels), 64), labels)


def test_the_training_length_is_marked_in_a_colour_and_style_no_model_has():
    """Black dash-dots: far from each of the 30 model colours (C7 is grey), in a line style none uses."""
    doc, groups = _position_doc([f"scheme {i}" for i in range(30)])
    fig = position_figure(doc, groups)
    ax = fig.axes[0]
    marks = [line for line in ax.lines if line.get_label().startswith("_") and len(set(line.get_xdata())) == 1]
    curves = [line for line in ax.lines if not line.get_label().startswith("_")]
    assert len(marks) == 1 and len(curves) == 30 and list(marks[0].get_xdata()) == [32, 32]
    (mark,) = marks
    assert mark.get_color() == TRAIN_LENGTH_LINE["color"] and mark.get_linestyle() == TRAIN_LENGTH_LINE["linestyle"]
    mark_rgb = np.array(matplotlib.colors.to_rgb(marks[0].get_color()))
    for curve in curves:
        assert np.linalg.norm(mark_rgb - matplotlib.colors.to_rgb(curve.get_color())) > 0.5
        assert marks[0].get_linestyle() != curve.get_linestyle()
    assert TRAIN_LENGTH_LINE["linestyle"] not in {line_style(i)["linestyle"] for i in range(30)}


@pytest.mark.plot
def test_probes_and_key_token_perplexity_in_the_report(runs, tmp_path):
    """`--eval.probes` per checkpoint and length (n/a with the reason where a cell cannot run), a table and a
    heatmap each in the report; `--eval.short_window 0` adds key-token perplexity at every length."""
    doc = _evaluate(tmp_path, "--ckpt", str(runs["rope"]), str(runs["learned"]), "--eval.lengths", "[16,48]",
                    "--eval.token_budget", "96", "--eval.short_window", "0", "--eval.probes", "[passkey,vt]",
                    "--eval.probe_lengths", "[16,64]", "--eval.probe_depths", "[0.5]", "--eval.probe_trials",
                    "2")  # fmt: skip
    rope, learned = ({(r["probe"], r["length"]): r for r in run["probes"]} for run in doc["runs"])
    assert len(rope) == 4 and not any(r["applicable"] for r in rope.values())
    assert all("cannot encode" in r["reason"] for r in rope.values())  # no digits in this corpus
    assert "positions exist up to 16" in learned["vt", 64]["reason"]
    assert all(row["key_tokens"] is not None for run in doc["runs"] for row in run["results"] if row["applicable"])
    table = (tmp_path / "out" / "results.md").read_text()
    assert "## passkey: accuracy (%) against length" in table and "## Key-token perplexity" in table
    assert_png(tmp_path / "out" / "probe_vt.png")
