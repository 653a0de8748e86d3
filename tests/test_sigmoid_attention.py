"""Sigmoid attention (Ramapuram et al. 2025) against its formula, written out here: the weights of a
small model by hand, the flex kernel's log-sum-exp identity (FlexAttention's reference path on the
CPU, where compiled flex returns no lse), and what the registry-driven tests do not show. The
parity matrix (test_kernels.py: the causality check) and the cache tests (test_cache.py) take the
function from the registry; its compiled flex kernel is checked against eager on a GPU (test_gpu.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import posgpt.model.attention.sigmoid as sigmoid_module
import posgpt.model.kernels.flex as flex_module
from posgpt.model import GPT, GPTConfig
from posgpt.model.kernels import KernelError

from helpers import assert_flex_matches_eager, fidelity

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False, attention="sigmoid",
                   pos_encoding="alibi")  # fmt: skip


@pytest.mark.parametrize(("bias", "T"), [("train_length", 7), ("train_length", 23), ("seen_keys", 7)])
@fidelity(
    "`attention: sigmoid`",
    paper="Ramapuram et al. 2025",
    code="apple/axlearn `SigmoidAttention`",
    default="sigmoid(score + bias − ln n), n = `block_size` at every length (`sigmoid_bias: train_length`)",
    deviations="`sigmoid_bias seen_keys`: n the keys each query sees (before issue 33)",
)
def test_the_weights_are_sigmoid_of_score_plus_bias_minus_log_n_by_hand(bias, T):
    """The paper (Ramapuram et al. 2025) and apple/axlearn's SigmoidAttention: b = -ln n, one constant, n the
    training sequence length (here block_size 16, also past it); seen_keys: n the keys each query sees."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, sigmoid_bias=bias)).eval()
    idx = torch.randint(0, 64, (1, T))
    seen = []
    with torch.no_grad():
        model.attention_weights(idx, lambda layer: (lambda rows, w: seen.append(w)) if layer == 0 else None)
        q, k, _ = model.blocks[0].attn.qkv(model.blocks[0].ln_1(model.wte(idx))).split(16, dim=-1)
    q, k = (t.view(1, T, 2, 8).transpose(1, 2) for t in (q, k))
    weights = torch.zeros(1, 2, T, T)
    slopes = [2.0**-4, 2.0**-8]  # ALiBi's for 2 heads
    for h in range(2):
        for i in range(T):
            for j in range(i + 1):
                score = (q[0, h, i] @ k[0, h, j]).item() / math.sqrt(8) - slopes[h] * (i - j)
                n = 16 if bias == "train_length" else i + 1
                weights[0, h, i, j] = 1 / (1 + math.exp(-(score - math.log(n))))
    got = torch.cat(seen, dim=2)
    torch.testing.assert_close(got, weights, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got.sum(-1), torch.ones(1, 2, T))  # no normalisation over the keys


@pytest.mark.parametrize("fields", [{}, {"attn_window": 4, "attn_sinks": 1}, {"pos_encoding": "rope"},
                                    {"attn_window": 4, "sigmoid_bias": "seen_keys"}],
                         ids=["alibi", "alibi-window+sinks", "rope", "alibi-window-seen-keys"])  # fmt: skip
def test_the_flex_kernels_lse_identity_gives_the_eager_output(monkeypatch, fields):
    """FlexAttention's own reference path (uncompiled) with the kernel's log-sigmoid score_mod, times
    exp(lse): the eager sigmoid output, with a bias, a window and sinks, at an odd length."""
    monkeypatch.setattr(flex_module, "compiled_flex_attention", lambda: flex_attention)  # SigmoidFlex calls it
    monkeypatch.setattr(sigmoid_module.SigmoidFlex, "devices", None)
    assert_flex_matches_eager(dataclasses.replace(CONFIG, n_layer=2, **fields), 21)


def test_flex_is_refused_on_a_cpu_and_auto_runs_eager_there():
    model = GPT(dataclasses.replace(CONFIG, attn_backend="flex"))
    with pytest.raises(KernelError, match="lacks a forward pass on cpu"):
        model(torch.randint(0, 64, (1, 5)))
    auto = GPT(CONFIG)
    assert type(auto.kernel(torch.device("cpu"), False, True)).__name__ == "SigmoidEager"


def test_a_sigmoid_model_learns_and_round_trips_a_checkpoint(tmp_path):
    from helpers import overfit

    model = GPT(dataclasses.replace(CONFIG, n_layer=2, attention="sigmoid", pos_encoding="rope"))
    first, final = overfit(model, steps=40, lr=1e-2)
    assert final < first / 3
    torch.save({"config": model.config.to_dict(), "state": model.state_dict()}, tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt")
    again = GPT(GPTConfig.from_dict(saved["config"]))
    again.load_state_dict(saved["state"])
    idx = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(again(idx)[0], model(idx)[0])
