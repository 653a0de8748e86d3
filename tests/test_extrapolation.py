"""The extrapolation evaluation against a direct, slow computation with the model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from posgpt.data.dataset import window_starts
from posgpt.evaluation.extrapolation import evaluate_length
from posgpt.model import GPT

from helpers import direct_loss


@pytest.fixture
def text_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 64, size=700).astype(np.uint16)


def _model(tiny_config, scheme: str) -> GPT:
    return GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)).eval()


@pytest.mark.parametrize("scheme", ["rope", "alibi", "sinusoidal"])
@pytest.mark.parametrize(("length", "stride"), [(16, 16), (40, 40), (40, 10), (64, 7)])
def test_matches_a_direct_computation(tiny_config, text_tokens, scheme, length, stride):
    model = _model(tiny_config, scheme)
    budget = 280
    result = evaluate_length(model, text_tokens, length, stride, token_budget=budget, batch_tokens=3 * length)
    expected = direct_loss(model, text_tokens, length, stride, budget=result.scored_tokens)
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.mode == ("nonoverlap" if stride == length else "sliding")
    assert result.ppl == pytest.approx(math.exp(expected), rel=1e-5)
    assert len(result.by_position) == min(8, stride)
    assert np.mean(result.by_position) == pytest.approx(result.loss, rel=1e-2)


def test_stride_equal_to_length_is_the_nonoverlap_result(tiny_config, text_tokens):
    model = _model(tiny_config, "alibi")
    a = evaluate_length(model, text_tokens, 32, None, token_budget=256)
    b = evaluate_length(model, text_tokens, 32, 32, token_budget=256)
    assert a.loss == b.loss and a.mode == b.mode == "nonoverlap"


def test_every_length_scores_the_same_budget(text_tokens):
    for length in (16, 32, 64):
        starts = window_starts(len(text_tokens), length, length, token_budget=256)
        assert starts.size * length == 256
    assert window_starts(len(text_tokens), 64, 8, token_budget=256).size == 32


def test_learned_beyond_its_length_is_not_applicable(tiny_config, text_tokens):
    model = _model(tiny_config, "learned")
    result = evaluate_length(model, text_tokens, 64)
    assert not result.applicable and "block_size=16" in result.reason and result.ppl is None
    assert evaluate_length(model, text_tokens, 16).applicable


def test_a_length_longer_than_the_text_is_refused(tiny_config, text_tokens):
    with pytest.raises(ValueError, match="too few for one window"):
        evaluate_length(_model(tiny_config, "rope"), text_tokens[:50], 64)


def test_out_of_memory_halves_the_batch_and_gives_the_same_result(tiny_config, text_tokens, monkeypatch):
    import posgpt.evaluation.extrapolation as engine

    model = _model(tiny_config, "rope")
    expected = evaluate_length(model, text_tokens, 32, token_budget=256, batch_tokens=8 * 32)
    real, sizes = engine._window_losses, []

    def small_memory(model, rows, stride, dtype):
        sizes.append(rows.size(0))
        if rows.size(0) > 2:
            raise torch.OutOfMemoryError("pretend the GPU is full")
        return real(model, rows, stride, dtype)

    monkeypatch.setattr(engine, "_window_losses", small_memory)
    monkeypatch.setattr(engine.torch.cuda, "empty_cache", lambda: None)
    result = evaluate_length(model, text_tokens, 32, token_budget=256, batch_tokens=8 * 32)
    assert sizes[:3] == [8, 4, 2] and set(sizes[3:]) == {2}
    assert result.loss == pytest.approx(expected.loss, rel=1e-6) and result.scored_tokens == expected.scored_tokens
