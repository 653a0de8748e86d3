"""KERPLE's logarithmic bias (Chi et al. 2022) against its formula, written out here: the bias by
hand, one layer of attention by hand, the gradients of r1 and r2 through every kernel that runs it
on a CPU, the clamp that keeps both positive, and a checkpoint round trip. The parity matrix
(test_kernels.py) and the cache tests (test_cache.py) take it from the registry like every scheme."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.model import GPT, GPTConfig

from helpers import fidelity, scheme_gradients

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False, pos_encoding="kerple")


def _set(model: GPT, r1: list[float], r2: list[float]) -> None:
    with torch.no_grad():
        model.pe.r1.copy_(torch.tensor(r1))
        model.pe.r2.copy_(torch.tensor(r2))


@fidelity(
    "`pos_encoding: kerple`",
    paper="Chi et al. 2022",
    code="chijames/KERPLE `ParallelKerpleLog`",
    default="−r1_h·log(1 + r2_h·(i − j)), r1 ~ U(0, 2), r2 ~ U(0, 1), shared by layers",
    deviations=(
        "their code clamps r1, r2 in place (`.data.clamp(min=eps)`) at each forward; here the forward pass uses max(r,"
        " 0.01) with a straight-through gradient, the parameters untouched (no option)"
    ),
)
def test_the_bias_is_minus_r1_log_of_one_plus_r2_d():
    model = GPT(CONFIG)
    _set(model, [1.0, 0.5], [1.0, 2.0])
    d = torch.arange(4.0)
    head0 = model.pe.bias().formula(torch.tensor(0), d, d)
    head1 = model.pe.bias().formula(torch.tensor(1), d, d)
    assert head0.tolist() == pytest.approx([0.0, -math.log(2), -math.log(3), -math.log(4)])
    assert head1.tolist() == pytest.approx([0.0, -0.5 * math.log(3), -0.5 * math.log(5), -0.5 * math.log(7)])
    masked = model.pe.bias().formula(torch.tensor(0), torch.tensor([-3.0]), torch.tensor(0))  # a future key
    assert masked.isfinite().all()


@fidelity("`pos_encoding: kerple`")
def test_r1_and_r2_are_used_at_least_eps():
    model = GPT(CONFIG)
    _set(model, [-1.0, 0.0], [-5.0, 0.0])  # an optimizer step may push them below zero
    eps = model.pe.EPS
    bias = model.pe.bias().formula(torch.tensor([[0], [1]]), torch.tensor([[10.0]]), torch.tensor(10))
    assert bias.flatten().tolist() == pytest.approx([-eps * math.log1p(eps * 10)] * 2)


def test_the_attention_weights_are_the_softmax_of_scores_plus_the_bias_by_hand():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    _set(model, [0.7, 1.3], [0.4, 2.5])
    idx = torch.randint(0, 64, (1, 6))
    seen = []
    with torch.no_grad():
        model.attention_weights(idx, lambda layer: (lambda rows, w: seen.append(w)) if layer == 0 else None)
        h = model.blocks[0].ln_1(model.wte(idx))  # kerple adds nothing to the embeddings
        q, k, _ = model.blocks[0].attn.qkv(h).split(16, dim=-1)
    q, k = (t.view(1, 6, 2, 8).transpose(1, 2) for t in (q, k))  # (1, H, T, D)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    r1, r2 = torch.tensor([0.7, 1.3])[:, None, None], torch.tensor([0.4, 2.5])[:, None, None]
    bias = -r1 * torch.log(1 + r2 * (i - j).clamp(min=0))  # (H, T, T)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8) + bias).masked_fill(j > i, float("-inf"))
    torch.testing.assert_close(torch.cat(seen, dim=2), scores.softmax(-1), rtol=1e-5, atol=1e-6)


def test_gradients_of_r1_and_r2_agree_on_eager_and_sdpa():
    eager, sdpa = scheme_gradients(dataclasses.replace(CONFIG, n_layer=2), 29)  # past block_size: any length
    assert set(eager) == {"r1", "r2"}
    for name, grad in eager.items():
        assert grad is not None and grad.abs().sum() > 0
        torch.testing.assert_close(sdpa[name], grad, rtol=1e-4, atol=1e-6)


def test_a_checkpoint_round_trips_the_learned_slopes(tmp_path):
    model = GPT(CONFIG)
    _set(model, [0.3, 1.7], [0.9, 0.2])
    torch.save({"config": CONFIG.to_dict(), "state": model.state_dict()}, tmp_path / "k.pt")
    saved = torch.load(tmp_path / "k.pt")
    again = GPT(GPTConfig.from_dict(saved["config"]))
    again.load_state_dict(saved["state"])
    assert again.pe.r1.tolist() == pytest.approx([0.3, 1.7]) and again.pe.r2.tolist() == pytest.approx([0.9, 0.2])
    idx = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(again(idx)[0], model(idx)[0])


def test_a_slope_pushed_below_eps_still_gets_a_gradient_and_can_come_back():
    model = GPT(CONFIG)
    _set(model, [-0.5, 1.0], [0.3, -2.0])
    idx = torch.randint(0, 64, (2, 12))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert model.pe.r1.grad[0] != 0 and model.pe.r2.grad[1] != 0  # the clamp passes the gradient through
