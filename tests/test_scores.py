"""Scoring functions: scaled dot product (Vaswani), dot (Luong), additive (Bahdanau)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import model.scores as scores
from model import GPT
from model.kernels import eager_attention
from model.scores import Additive, Dot, ScaledDot

from helpers import eager_with_weights, overfit


def test_dot_is_the_scaled_dot_product_without_the_scale():
    q, k, v = torch.randn(3, 2, 2, 7, 16, dtype=torch.float64).unbind(0)
    unscaled = eager_attention(q, k, v, score=Dot())
    scaled = eager_attention(q * math.sqrt(16), k, v, score=ScaledDot(16))
    torch.testing.assert_close(unscaled, scaled)
    assert not torch.allclose(unscaled, eager_attention(q, k, v))  # the default scales


def test_the_additive_score_by_hand():
    score = Additive(n_head=2, head_dim=4).double()
    q, k = torch.randn(2, 1, 2, 3, 4, dtype=torch.float64).unbind(0)
    got = score(q, k)  # (1, 2, 3, 3)
    h, i, j = 1, 2, 0
    expected = score.v[h] @ torch.tanh(q[0, h, i] @ score.w_q[h] + k[0, h, j] @ score.w_k[h])
    torch.testing.assert_close(got[0, h, i, j], expected)


def test_the_additive_score_in_chunks_of_queries_equals_one_pass(monkeypatch):
    score = Additive(n_head=2, head_dim=4).double()
    q, k, v = torch.randn(3, 2, 2, 11, 4, dtype=torch.float64).unbind(0)
    whole, weights = eager_with_weights(q, k, v, score=score)
    monkeypatch.setattr(scores, "ADDITIVE_CHUNK_ELEMENTS", 2 * 2 * 11 * 4 * 3)  # 3 queries at a time
    assert score.query_chunk(q, k) == 3
    chunked, chunked_weights = eager_with_weights(q, k, v, score=score)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked_weights, weights)


def test_additive_runs_on_eager_only(tiny_config):
    config = dataclasses.replace(tiny_config, attn_score="additive")
    model = GPT(config)
    with pytest.raises(ValueError, match="cannot run attn_score=.additive.*attn_backend auto or eager"):
        dataclasses.replace(config, attn_backend="sdpa")
    assert sum(p.numel() for p in model.blocks[0].attn.score.parameters()) == config.n_head * (
        2 * config.head_dim**2 + config.head_dim
    )


@pytest.mark.parametrize("kind", ["dot", "additive"])
@pytest.mark.parametrize("scheme", ["learned", "alibi"])
def test_each_score_overfits_and_decodes_the_same_with_and_without_cache(tiny_config, kind, scheme):
    model = GPT(dataclasses.replace(tiny_config, attn_score=kind, pos_encoding=scheme))
    _, final = overfit(model, steps=120)
    assert final < 0.3
    model.eval()
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 3))
    cached, uncached = (model.generate(prompt, 20, temperature=0, use_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached)
