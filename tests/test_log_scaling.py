"""Log-length attention scaling (`attn_log_scaling`, SSMax): queries times s_h ln(n), n the keys a
query sees; against the formula written here, the key counts of every mask by hand, learned s
getting gradients alike on every CPU kernel, a cache equal to the full forward, and the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import GPT, GPTConfig
from posgpt.model.masks import AttentionMask

from helpers import fidelity

BASE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=False, pos_encoding="none",
                 attn_log_scaling="fixed")  # fmt: skip


@fidelity("`attn_log_scaling: fixed`, `learned` (SSMax)")
def test_the_keys_each_query_sees_by_hand():
    q = torch.arange(7)
    assert AttentionMask().seen_keys(q).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert AttentionMask(window=3).seen_keys(q).tolist() == [1, 2, 3, 3, 3, 3, 3]
    assert AttentionMask(window=3, sinks=2).seen_keys(q).tolist() == [1, 2, 3, 4, 5, 5, 5]


def test_the_default_scale_is_one_at_the_training_length():
    model = GPT(BASE)
    s = model.blocks[0].attn.log_scale.s
    assert s.tolist() == pytest.approx([1 / math.log(16)] * 2)
    assert float(s[0]) * math.log(16) == pytest.approx(1.0)


@fidelity(
    "`attn_log_scaling: fixed`, `learned` (SSMax)",
    paper="Nakanishi 2025",
    code="none found: the paper's formula",
    default="off; each query × s·ln n, n the keys it sees, s = 1/ln(block_size)",
    deviations="the query is scaled, so a scheme's bias is not (no option); s learned per head and layer: `learned`",
)
def test_the_attention_weights_are_the_softmax_of_the_scaled_scores_by_hand():
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, attn_log_scale=0.7)).eval()
    idx = torch.randint(0, 64, (1, 6))
    seen = []
    with torch.no_grad():
        model.attention_weights(idx, lambda layer: (lambda rows, w: seen.append(w)) if layer == 0 else None)
        h = model.blocks[0].ln_1(model.wte(idx))
        q, k, _ = model.blocks[0].attn.qkv(h).split(16, dim=-1)
    q, k = (t.view(1, 6, 2, 8).transpose(1, 2) for t in (q, k))
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    factor = 0.7 * torch.log(i + 1.0)  # query i sees i + 1 keys
    scores = (factor * (q @ k.transpose(-2, -1)) / math.sqrt(8)).masked_fill(j > i, float("-inf"))
    torch.testing.assert_close(torch.cat(seen, dim=2), scores.softmax(-1), rtol=1e-5, atol=1e-6)


def test_learned_scales_get_the_same_gradients_on_eager_and_sdpa():
    results = []
    for backend in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(BASE, attn_log_scaling="learned", pos_encoding="alibi", attn_backend=backend))
        idx = torch.randint(0, 64, (2, 25))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append([block.attn.log_scale.s.grad for block in model.blocks])
    for eager, sdpa in zip(*results, strict=True):
        assert eager.abs().sum() > 0
        torch.testing.assert_close(sdpa, eager, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mask", [{}, {"attn_window": 4, "attn_sinks": 2}], ids=["causal", "window-sinks"])
def test_decoding_with_a_cache_equals_the_full_forward(mask):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, attn_log_scaling="learned", pos_encoding="rope", **mask)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.log_scale.s.mul_(torch.tensor([0.5, 2.0]))  # heads apart
        idx = torch.randint(0, 64, (2, 12))
        full = model(idx)[0]
        cache = model.new_cache(16, batch=2)
        steps = [model(idx[:, :5], cache=cache)[0]] + [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"attention": "linear"}, "attention='linear' forms none"),
        ({"attn_log_scale": -1.0}, "attn_log_scale must be positive"),
        ({"attn_log_scaling": "sometimes"}, "attn_log_scaling must be one of"),
    ],
)
def test_settings_that_cannot_run_are_one_clear_message(fields, needle):
    with pytest.raises(ConfigError) as error:
        dataclasses.replace(BASE, **fields)
    assert needle in str(error.value)


def test_a_score_that_is_not_a_dot_product_is_refused():
    with pytest.raises(ConfigError, match="attn_score='additive' is not one"):
        dataclasses.replace(BASE, attn_score="additive")
