"""Scoring functions: scaled dot product (Vaswani), dot and general (Luong), additive (Bahdanau)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import posgpt.model.scores as scores
from posgpt.model import GPT
from posgpt.model.kernels import eager_attention
from posgpt.model.scores import Additive, Dot, General, ScaledDot

from helpers import eager_with_weights, fidelity, overfit


@fidelity("`attn_score: dot`", paper="Luong et al. 2015", code="none", default="q·k", deviations="none")
def test_dot_is_the_scaled_dot_product_without_the_scale():
    q, k, v = torch.randn(3, 2, 2, 7, 16, dtype=torch.float64).unbind(0)
    unscaled = eager_attention(q, k, v, score=Dot())
    scaled = eager_attention(q * math.sqrt(16), k, v, score=ScaledDot(16))
    torch.testing.assert_close(unscaled, scaled)
    assert not torch.allclose(unscaled, eager_attention(q, k, v))  # the default scales


@fidelity(
    "`attn_score: additive`",
    paper="Bahdanau et al. 2015",
    code="none",
    default="v_hᵀ tanh(W_q q + W_k k) per head",
    deviations="eager kernel only, in chunks of queries (no option)",
)
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
    _, final = overfit(model, steps=60, lr=1e-2)
    assert final < 0.3
    model.eval()
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 3))
    cached, uncached = (model.generate(prompt, 20, temperature=0, use_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached)


@fidelity(
    "`attn_score: general`",
    paper="Luong et al. 2015",
    code="none",
    default="qᵀW_h k per head",
    deviations="W_h starts at I/√d (equal to `scaled_dot`); RoPE rotates q W_h (no option)",
)
def test_the_general_score_by_hand():
    score = General(n_head=2, head_dim=4).double()
    with torch.no_grad():
        score.w.copy_(torch.randn(2, 4, 4, dtype=torch.float64))
    q, k = torch.randn(2, 1, 2, 3, 4, dtype=torch.float64).unbind(0)
    got = score(score.queries(q), k)  # (1, 2, 3, 3): what the layer hands every kernel
    h, i, j = 1, 2, 0
    torch.testing.assert_close(got[0, h, i, j], q[0, h, i] @ score.w[h] @ k[0, h, j])  # q^T W k, no scale


@fidelity("`attn_score: general`")
def test_the_general_score_starts_as_the_scaled_dot_product(tiny_config):
    torch.manual_seed(0)
    general = GPT(dataclasses.replace(tiny_config, attn_score="general", pos_encoding="rope"))
    plain = GPT(dataclasses.replace(tiny_config, pos_encoding="rope"))
    plain.load_state_dict(general.state_dict(), strict=False)  # every weight but W
    idx = torch.randint(0, tiny_config.vocab_size, (2, 12))
    torch.testing.assert_close(general(idx)[0], plain(idx)[0], rtol=1e-5, atol=1e-5)
    assert {n for n, _ in general.named_parameters()} - {n for n, _ in plain.named_parameters()} == {
        f"blocks.{i}.attn.score.w" for i in range(tiny_config.n_layer)
    }


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_the_general_scores_attention_weights_by_hand_and_its_gradient(tiny_config, backend):
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config, attn_score="general", pos_encoding="alibi", attn_backend=backend)
    model = GPT(config)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.score.w.add_(0.3 * torch.randn_like(block.attn.score.w))  # away from the start
    idx = torch.randint(0, config.vocab_size, (1, 7))
    seen = []
    with torch.no_grad():
        model.attention_weights(idx, lambda layer: (lambda rows, w: seen.append(w)) if layer == 0 else None)
        h = model.blocks[0].ln_1(model.wte(idx))
        q, k, _ = model.blocks[0].attn.qkv(h).split(config.n_embd, dim=-1)
    H, D = config.n_head, config.head_dim
    q, k = (t.view(1, 7, H, D).transpose(1, 2) for t in (q, k))
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    slopes = model.pe.slopes[:, None, None]
    scores = torch.einsum("bhid,hde,bhje->bhij", q, model.blocks[0].attn.score.w, k) - slopes * (i - j)
    weights = scores.masked_fill(j > i, float("-inf")).softmax(-1)
    torch.testing.assert_close(torch.cat(seen, dim=2), weights, rtol=1e-5, atol=1e-6)
    _, loss = model(idx, idx)
    loss.backward()
    assert all(block.attn.score.w.grad.abs().sum() > 0 for block in model.blocks)


def test_the_general_score_with_rope_depends_on_relative_positions_only(tiny_config):
    """q W is formed before RoPE rotates it: with a W far from the identity, shifting every
    position changes no logit (applied after the rotation, it would)."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(tiny_config, attn_score="general", pos_encoding="rope")).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.score.w.copy_(torch.randn_like(block.attn.score.w))
    idx = torch.randint(0, tiny_config.vocab_size, (1, 10))
    model.pe.reserve(17)  # the rotation tables cover the shifted positions
    with torch.no_grad():
        plain = model(idx)[0]
        shifted = model(idx, positions=torch.arange(10)[None] + 7)[0]
    torch.testing.assert_close(shifted, plain, rtol=1e-4, atol=1e-4)
