"""The sink rate is Gu et al.'s (ICLR 2025, "When Attention Sink Emerges in Language Models"), written
here from their definition, not from our accumulator: per sample (window), layer and head,
alpha_0 = sum over all T queries of the weight on token 0, divided by T; a head is a sink in that
sample when alpha_0 > 0.3; the rate is the mean of those indicators over samples, layers and heads.
Thresholding the mean of alpha_0 over windows instead (the number reported before issue 33) fails
these tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from posgpt.evaluation.attention_stats import SINK_RATE_DEFINITION, AttentionStats
from posgpt.evaluation.report import sink_rate_table
from posgpt.model import GPT, GPTConfig
from posgpt.model.kernels import eager

from helpers import fidelity

EPSILON = 0.3


def paper_sink_rate(weights: Tensor) -> tuple[float, np.ndarray]:
    """Gu et al.'s sink rate, and per layer, from full weights (samples, layers, heads, T, T) in
    float64: alpha_0 per sample, layer and head, thresholded, then averaged."""
    T = weights.size(-1)
    alpha0 = weights[..., :, 0].sum(-1) / T  # (samples, layers, heads): every query sees key 0's column
    sinks = (alpha0 > EPSILON).double()
    return float(sinks.mean()), sinks.mean(dim=(0, 2)).numpy()


def _with_first_token_mass(alpha0: float, T: int) -> Tensor:
    """A causal (T, T) attention matrix whose first-token weight averaged over the T queries is alpha0:
    query 0 puts 1 on token 0 (its only key), every later query puts `a` on it and spreads 1 - a evenly
    over its other keys, so alpha0 = (1 + (T - 1) a) / T."""
    a = (T * alpha0 - 1) / (T - 1)
    assert 0 <= a <= 1
    w = torch.zeros(T, T, dtype=torch.float64)
    w[0, 0] = 1.0
    for i in range(1, T):
        w[i, 0] = a
        w[i, 1 : i + 1] = (1 - a) / i
    return w


@pytest.mark.parametrize("batches", [[2], [1, 1]], ids=["one batch", "two batches"])
@fidelity(
    "sink rate (evaluation statistic)",
    paper="Gu et al. 2025",
    code="sail-sg/Attention-Sink `compute_attention_sink`",
    default="α₀ per window, layer and head; the share of them with α₀ > 0.3",
    deviations="none (before issue 33: α₀ averaged over windows, then thresholded; reports keep it apart)",
)
def test_two_windows_one_head_over_the_threshold_in_one_of_them(batches):
    """Eight heads, two windows: head 0 has alpha_0 = 0.5 in the first window and 0.2 in the second,
    every other head 0.1 in both. One (window, head) pair of 16 is a sink: 1/16 (the mean 0.35 of
    head 0 over the windows, thresholded, would say 1/8). The rows come in two uneven chunks."""
    T, H = 11, 8
    alpha0 = torch.full((2, H), 0.1, dtype=torch.float64)
    alpha0[:, 0] = torch.tensor([0.5, 0.2])
    weights = torch.stack([torch.stack([_with_first_token_mass(float(a), T) for a in window]) for window in alpha0])
    torch.testing.assert_close(weights[..., 0].mean(-1), alpha0)  # (2, H, T, T) built as meant
    stats = AttentionStats(n_layer=1, n_head=H, length=T, sink_tokens=1, device=torch.device("cpu"))
    hook, start = stats.hook(0), 0
    for size in batches:
        window = weights[start : start + size]
        hook(slice(0, 4), window[:, :, :4])
        hook(slice(4, T), window[:, :, 4:])
        stats.windows += size
        start += size
    rate = stats.summary()["sink_rate"]
    assert paper_sink_rate(weights[:, None])[0] == 1 / 16
    assert rate["model"] == 1 / 16 and rate["per_layer"] == [1 / 16]
    assert rate["per_head"][0] == [0.5] + [0.0] * 7  # head 0 is a sink in one window of two
    assert rate["first_token_mass"][0] == pytest.approx([0.35] + [0.1] * 7)
    assert rate["threshold"] == EPSILON and rate["definition"] == SINK_RATE_DEFINITION


def test_a_window_exactly_at_the_threshold_is_not_a_sink():
    """The comparison is strict, as in the authors' code (`importance_scores > epsilon`)."""
    T = 11
    stats = AttentionStats(n_layer=1, n_head=1, length=T, sink_tokens=1, device=torch.device("cpu"))
    stats.hook(0)(slice(0, T), _with_first_token_mass(0.3, T)[None, None])
    stats.windows += 1
    assert stats.summary()["sink_rate"]["model"] == 0.0


def test_a_summary_before_every_row_of_a_batch_refuses():
    stats = AttentionStats(n_layer=1, n_head=1, length=11, sink_tokens=1, device=torch.device("cpu"))
    stats.hook(0)(slice(0, 4), _with_first_token_mass(0.5, 11)[None, None, :4])
    stats.windows += 1
    with pytest.raises(RuntimeError, match="before all its query rows"):
        stats.summary()


def _sharp_model(**fields) -> GPT:
    """A random tiny model with its q/k/v weights scaled up, so that attention varies from window to
    window (at the usual init it is nearly uniform, alpha_0 about the same in every window)."""
    torch.manual_seed(0)
    base = {"vocab_size": 40, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 16, "bias": False}
    model = GPT(GPTConfig(**{**base, **fields})).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8.0)
    return model


def _full_weights(model: GPT, idx: Tensor) -> Tensor:
    """(B, layers, heads, T, T) float64: every weight of the float32 reference path, all rows."""
    chunks: list[list[Tensor]] = [[] for _ in model.blocks]

    def visit(layer: int):
        return lambda rows, weights: chunks[layer].append(weights)

    with torch.no_grad():
        model.attention_weights(idx, visit)
    return torch.stack([torch.cat(c, dim=2) for c in chunks], dim=1).double()


@pytest.mark.parametrize(
    "fields", [{"pos_encoding": "rope"}, {"pos_encoding": "alibi", "attn_window": 5, "attn_sinks": 1}], ids=str
)
@fidelity("sink rate (evaluation statistic)")
def test_the_accumulator_equals_the_papers_formula_on_a_tiny_model(fields, monkeypatch):
    """Eight windows of 10 tokens in batches of 3, 3 and 2, handed over 3 or 4 query rows at a time,
    against the paper's formula on the whole float64 weights of the same windows."""
    model = _sharp_model(**fields)
    T, H = 10, 4
    idx = torch.randint(0, 40, (8, T))
    weights = _full_weights(model, idx)
    expected, per_layer = paper_sink_rate(weights)
    alpha0_mean = weights[..., 0].mean(-1).mean(0)  # (layers, heads), alpha_0 averaged over windows
    assert expected != pytest.approx(float((alpha0_mean > EPSILON).double().mean()))  # the two metrics differ here

    monkeypatch.setattr(eager, "WEIGHTS_CHUNK_ELEMENTS", 3 * H * T * 3)  # 3 query rows per chunk of 3 windows
    stats = AttentionStats(n_layer=2, n_head=H, length=T, sink_tokens=1, device=torch.device("cpu"))
    with torch.no_grad():
        for batch in idx.split(3):
            stats.add_windows(model, batch)
    rate = stats.summary()["sink_rate"]
    assert stats.windows == 8
    assert rate["model"] == pytest.approx(expected, abs=1e-9)
    np.testing.assert_allclose(rate["per_layer"], per_layer, atol=1e-9)
    np.testing.assert_allclose(rate["first_token_mass"], alpha0_mean.numpy(), rtol=1e-5)


def _entry(label: str, length: int, rate: dict) -> dict:
    return {"label": label, "length": length, "summary": {"sink_rate": rate}}


def test_the_report_names_the_metric_and_keeps_older_statistics_apart():
    """A sink rate written before issue 33 (no `definition`: the mean over windows thresholded) is not
    shown as Gu et al.'s sink rate."""
    new = {"definition": SINK_RATE_DEFINITION, "threshold": 0.3, "model": 0.0625}
    old = {"threshold": 0.3, "model": 0.25, "per_layer": [0.25], "first_token_mass": [[0.35, 0.1, 0.1, 0.1]]}
    lines = sink_rate_table([_entry("rope", 64, new), _entry("alibi", 64, old)], [64])
    text = "\n".join(lines)
    gu, before = text.index("## Sink rate (Gu et al. 2025)"), text.index("## Not the sink rate")
    assert "| rope | 0.06 |" in text[gu:before] and "| alibi |" not in text[:before]
    assert "| alibi | 0.25 |" in text[before:]
    assert "before issue 33" in text[before:]
    only_old = "\n".join(sink_rate_table([_entry("alibi", 64, old)], [64]))
    assert "## Sink rate" not in only_old and "| alibi | 0.25 |" in only_old
