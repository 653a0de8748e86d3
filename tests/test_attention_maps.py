"""Attention maps: the weights recomputed on the reference path (rows sum to 1 over the visible keys,
0 elsewhere; the recomputed logits are the model's), the statistics against a direct computation on
a hand-made attention matrix, chunking that changes nothing, and attention_maps.py end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_text

import attention_maps as maps_script
import evaluate as evaluate_script
from posgpt.core import cli
from posgpt.core.errors import ConfigError
from posgpt.evaluation.attention import prompt_weights, visible_keys
from posgpt.evaluation.attention_stats import AttentionStats, bucket_means, log_edges
from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig
from posgpt.model.attention import linear as linear_attention
from posgpt.model.kernels import eager
from posgpt.model.scores import SCORES

from helpers import assert_png, cli_error, scheme_kinds, train_tiny

MASKS = {"causal": {}, "window": {"attn_window": 5}, "window+sinks": {"attn_window": 5, "attn_sinks": 2}}
BASE = {"vocab_size": 40, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16, "bias": False}
KINDS = scheme_kinds()
IN_ATTENTION = {
    "rotation": KINDS["rotation"],
    "bias": KINDS["fixed bias"],
    "nothing": next(name for name, s in SCHEMES.items() if not (s.embeds or s.rotates or s.terms or s.uses_positions)),
}
"""A scheme for each hook that acts in the attention layer, and one with no position signal (an embedding acts
before the layer, the same for every function), read from what the schemes declare."""


def _model(**fields) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**BASE, **fields})).eval()


def _runs(fields: dict) -> bool:
    """Whether a model of `fields` can be built (linear attention refuses a bias)."""
    try:
        GPTConfig(**{**BASE, **fields})
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("scheme", KINDS.values())
def test_weights_are_distributions_over_the_visible_keys(scheme, mask):
    model = _model(pos_encoding=scheme, **MASKS[mask])
    weights = prompt_weights(model, torch.randint(0, 40, (1, 23)))
    visible = visible_keys(model, 23)
    for layer in weights:  # (H, T, T)
        assert torch.all(layer.masked_select(~visible) == 0)  # exactly 0 on masked keys
        torch.testing.assert_close(layer.sum(-1), torch.ones(2, 23))
    if mask != "causal":  # the window leaves keys out, and the sinks stay in
        assert not visible[22, 10] and visible[22, 18] and visible[22, 0] == ("sinks" in mask)


VARIANTS = [{"pos_encoding": s, **m} for s in SCHEMES for m in MASKS.values()]  # the default function: every scheme
VARIANTS += [fields for f in ATTENTIONS if f != GPTConfig.attention for s in IN_ATTENTION.values()  # the others
             if _runs(fields := {"pos_encoding": s, "attention": f})]  # fmt: skip
VARIANTS += [{"pos_encoding": KINDS["learned bias"], "attn_score": score} for score in SCORES  # each other score
             if score != GPTConfig.attn_score]  # fmt: skip
VARIANTS += [{"pos_encoding": KINDS["rotation"], "attn_score": score, "attn_window": 5} for score in SCORES
             if score != GPTConfig.attn_score]  # fmt: skip


@pytest.mark.parametrize("fields", VARIANTS, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_the_recomputation_gives_the_models_own_logits(fields):
    model = _model(**fields)
    longest = model.pe.max_positions  # past block_size, but for a scheme with a longest position
    idx = torch.randint(0, 40, (2, 45 if longest is None else longest))
    seen = set()

    def visit(layer: int):
        return lambda rows, weights: seen.add(layer)

    torch.testing.assert_close(model.attention_weights(idx, visit), model(idx)[0], rtol=1e-5, atol=1e-5)
    assert seen == {0, 1}


def _direct(weights: np.ndarray, sinks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean weight at each distance, entropy and sink mass at each position, by plain loops over one
    layer's weights (B, H, T, T)."""
    B, H, T, _ = weights.shape
    distance = np.zeros((H, T))
    entropy = np.zeros((H, T))
    sink = np.zeros((H, T))
    for h in range(H):
        for d in range(T):
            values = [weights[b, h, i, i - d] for b in range(B) for i in range(d, T)]
            distance[h, d] = sum(values) / len(values)
        for i in range(T):
            rows = [weights[b, h, i] for b in range(B)]
            entropy[h, i] = np.mean([-sum(p * math.log(p) for p in row if p > 0) for row in rows])
            sink[h, i] = np.mean([row[:sinks].sum() for row in rows])
    return distance, entropy, sink


@pytest.mark.parametrize("length", [10, 40])
def test_statistics_equal_a_direct_computation(length):
    """A hand-made causal matrix with a window, fed in two uneven chunks of queries."""
    generator = torch.Generator().manual_seed(0)
    B, H, T = 3, 2, length
    pos = torch.arange(T)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 7)
    scores = torch.randn(B, H, T, T, generator=generator, dtype=torch.float64)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    stats = AttentionStats(n_layer=1, n_head=H, length=T, sink_tokens=3, device=torch.device("cpu"))
    hook = stats.hook(0)
    hook(slice(0, 4), weights[:, :, :4])
    hook(slice(4, T), weights[:, :, 4:])
    stats.windows += B
    summary = stats.summary()
    distance, entropy, sink = _direct(weights.numpy(), sinks=3)
    edges = log_edges(T)
    assert edges[0] == 0 and edges[-1] == T and edges == sorted(set(edges))
    assert summary["distance"]["edges"] == edges
    np.testing.assert_allclose(summary["distance"]["mean_weight"][0], bucket_means(distance, edges), rtol=1e-5)
    np.testing.assert_allclose(summary["position"]["entropy"][0], bucket_means(entropy, edges), rtol=1e-5)
    np.testing.assert_allclose(summary["position"]["sink_mass"][0], bucket_means(sink, edges), rtol=1e-5)
    assert max(summary["distance"]["mean_weight"][0][0][edges.index(7) :]) == 0  # nothing past the window


@pytest.mark.parametrize(  # one model for each module whose reference hands the weights over in chunks (patched below)
    "fields", [{"pos_encoding": "alibi", "attn_window": 9}, {"pos_encoding": "rope", "attention": "linear"}]
)
def test_small_chunks_change_nothing(fields, monkeypatch):
    """Weights handed over a few query rows at a time (as at long lengths) give the same statistics
    and logits as all rows at once."""
    model = _model(**fields)
    idx = torch.randint(0, 40, (2, 50))
    results = []
    for elements in (1 << 24, 2 * 2 * 50 * 3):  # everything at once; 3 query rows per chunk
        monkeypatch.setattr(eager, "WEIGHTS_CHUNK_ELEMENTS", elements)
        monkeypatch.setattr(linear_attention, "WEIGHTS_CHUNK_ELEMENTS", elements)
        stats = AttentionStats(2, 2, 50, 4, torch.device("cpu"))
        chunks = []

        def visit(layer: int, stats=stats, chunks=chunks):
            hook = stats.hook(layer)
            return lambda rows, weights: (chunks.append(rows.stop - rows.start), hook(rows, weights))

        logits = model.attention_weights(idx, visit)
        stats.windows += 2
        results.append((logits, stats.summary(), max(chunks)))
    (whole, whole_stats, biggest), (chunked, chunked_stats, smallest) = results
    assert biggest == 50 and smallest == 3
    torch.testing.assert_close(chunked, whole)
    for key, field in (("distance", "mean_weight"), ("position", "entropy"), ("position", "sink_mass")):
        np.testing.assert_allclose(chunked_stats[key][field], whole_stats[key][field], rtol=1e-5, atol=1e-7)


# attention_maps.py and evaluate.py on tiny trained checkpoints


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("maps")
    text = tmp / "corpus.txt"
    text.write_text(make_text(600))
    return {
        "window": train_tiny(tmp, text, "window", pos_encoding="alibi", attn_window=6, attn_sinks=1),
        "learned": train_tiny(tmp, text, "learned", pos_encoding="learned"),
        "text": text,
    }


@pytest.mark.plot
@pytest.mark.slow
def test_heatmaps_and_long_context_figures(runs, tmp_path):
    out = tmp_path / "maps"
    cli.run(maps_script.COMMAND, ["--ckpt", str(runs["window"]), str(runs["learned"]), "--prompt", "The cat sat.",
                      "--layers", "1", "--heads", "0", "2", "--lengths", "8", "32", "--tokens", "64", "--out", str(out),
                      "--progress", "false"])  # fmt: skip
    for name in ("window/layer1.png", "window/layers_mean.png", "learned/layer1.png", "attention_L8.png",
                 "attention_L32.png"):  # fmt: skip
        assert_png(out / name)
    assert not (out / "window" / "layer0.png").exists()  # --layers 1 only
    doc = json.loads((out / "results.json").read_text())
    prompt = doc["prompts"][0]
    weights = np.array(prompt["weights"]["1"])  # (heads, T, T) as plotted: heads 0 and 2 of 4
    assert prompt["tokens"][3] == "␣" and weights.shape == (2, 12, 12) and prompt["heads"] == [0, 2]
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-4)
    assert weights[0, 11, 2] == 0 and weights[0, 11, 0] > 0  # outside the window of 6; the sink
    entries = doc["lengths"]
    # learned positions stop at 16: left out at 32
    assert {(e["label"], e["length"]) for e in entries} == {("window", 8), ("learned", 8), ("window", 32)}
    assert all(e["summary"]["windows"] == 64 // e["length"] for e in entries)


def test_a_failed_write_ends_in_one_line_and_leaves_no_results_json(runs, tmp_path, monkeypatch, capsys):
    from posgpt.evaluation import attention

    out = tmp_path / "maps"
    real_write = attention.atomic_write_bytes

    def full_disk(path, payload):
        if path.name == "results.json":
            raise OSError(28, "No space left on device", str(path))
        real_write(path, payload)

    monkeypatch.setattr(attention, "atomic_write_bytes", full_disk)
    line = cli_error(capsys, maps_script.COMMAND, ["--ckpt", str(runs["window"]), "--prompt", "The cat",
                                                   "--out", str(out), "--progress", "false"])  # fmt: skip
    assert "cannot write the figures" in line and "No space left on device" in line
    assert not (out / "results.json").exists()


def _fails(capsys, *args: str) -> str:
    return cli_error(capsys, maps_script.COMMAND, [*args, "--progress", "false"])


def test_mistakes_end_in_one_clear_message(runs, tmp_path, capsys):
    ckpt, out = str(runs["window"]), ["--out", str(tmp_path / "x")]
    assert "readable up to 64" in _fails(capsys, "--ckpt", ckpt, "--prompt", "a" * 65, *out)
    assert "there is no layer 2" in _fails(capsys, "--ckpt", ckpt, "--prompt", "The", "--layers", "2", *out)
    assert "there is no head 7" in _fails(capsys, "--ckpt", ckpt, "--prompt", "The", "--heads", "0", "7", *out)
    learned = _fails(capsys, "--ckpt", str(runs["learned"]), "--lengths", "16", "64", *out)
    assert "exist up to 16 tokens" in learned and "asks for 64" in learned
    assert "Nothing to draw" in _fails(capsys, "--ckpt", ckpt, *out)
    assert "Checkpoint not found" in _fails(capsys, "--ckpt", "nope.ckpt", "--prompt", "The", *out)
    assert not (tmp_path / "x").exists()  # nothing written


def test_evaluate_adds_the_figures_with_one_option(runs, tmp_path):
    """The attention figures built (conftest: not rendered): `stats_pngs`, which attention_maps.py renders
    in test_heatmaps_and_long_context_figures (decoded there)."""
    out = tmp_path / "eval"
    cli.run(evaluate_script.COMMAND, ["--ckpt", str(runs["window"]), str(runs["learned"]), "--eval.lengths", "[8,32]",
                          "--eval.token_budget", "64", "--eval.attention_stats", "true", "--eval.progress", "false",
                          "--out", str(out)])  # fmt: skip
    assert {"attention_L8.png", "attention_L32.png", "ppl_vs_length.png"} <= {path.name for path in out.iterdir()}
    doc = json.loads((out / "results.json").read_text())
    assert {(e["label"], e["length"]) for e in doc["attention"]} == {("window", 8), ("window", 32), ("learned", 8)}
    report = (out / "results.md").read_text()
    header = "## Sink rate (Gu et al. 2025): share of (window, layer, head) whose first-token weight, averaged over "
    assert header + "the window's queries, is > 0.3" in report and "Not the sink rate" not in report
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| window |")
            or line.startswith("| learned |")}  # fmt: skip
    assert rows["learned"].rstrip(" |").endswith("n/a")  # learned positions stop at block_size
    rate = next(e for e in doc["attention"] if e["label"] == "window")["summary"]["sink_rate"]
    assert len(rate["per_layer"]) == 2 and 0 <= rate["model"] <= 1
    cli.run(evaluate_script.COMMAND, ["--ckpt", str(runs["window"]), "--eval.lengths", "[16]", "--eval.token_budget",
                                      "64", "--eval.attention_stats", "true", "--eval.progress", "false", "--out",
                                      str(out)])  # fmt: skip
    assert sorted(p.name for p in out.glob("attention_L*.png")) == ["attention_L16.png"]  # no earlier length left


def test_the_sink_rate_of_one_window_is_the_share_of_heads_whose_first_token_weight_passes_the_threshold():
    """Gu et al.'s sink rate by hand on one window (tests/test_sink_rate.py has several): layer 0 has
    one head of two on the first token (mean weight over queries 0.68 > 0.3) and one spread evenly
    over the visible keys (mean 0.21); layer 1 none."""
    T = 16
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]
    uniform = causal.double() / causal.sum(-1, keepdim=True)  # 1 / (i + 1) on each visible key
    sink_head = uniform * 0.4
    sink_head[:, 0] += 0.6  # 0.6 more on the first token, rows still summing to 1
    stats = AttentionStats(n_layer=2, n_head=2, length=T, sink_tokens=1, device=torch.device("cpu"))
    stats.hook(0)(slice(0, T), torch.stack([sink_head, uniform])[None])
    stats.hook(1)(slice(0, T), torch.stack([uniform, uniform])[None])
    stats.windows += 1
    rate = stats.summary()["sink_rate"]
    first_uniform = float((1 / (pos + 1.0)).mean())
    assert rate["first_token_mass"][0] == pytest.approx([0.6 + 0.4 * first_uniform, first_uniform], rel=1e-5)
    assert rate["threshold"] == 0.3 and rate["per_layer"] == [0.5, 0.0] and rate["model"] == 0.25
    assert rate["per_head"] == [[1.0, 0.0], [0.0, 0.0]]
