"""FIRE (Li et al. 2024) against its formula, written out here: the normalized distance and the bias
by hand, one layer of attention by hand, gradients of every FIRE parameter through the kernels that
run it on a CPU, the flex score_mod against the dense bias, and a checkpoint round trip. The parity
matrix (test_kernels.py) and the cache tests (test_cache.py) take it from the registry."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import GPT, GPTConfig

from helpers import assert_flex_matches_eager, fidelity, scheme_gradients, uncompiled_flex

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False, pos_encoding="fire",
                   fire_width=3)  # fmt: skip


def _set(model: GPT, c: float, threshold: float) -> None:
    """c, L, and an MLP whose hidden units are relu(x), relu(2x - 1), relu(1 - x); head 0 sums them
    with weights 1, 1, 0 and adds 0.5, head 1 takes -3 x the third."""
    pe = model.pe
    with torch.no_grad():
        pe.c.fill_(c)
        pe.threshold_scale.fill_(threshold / pe.initial_threshold.item())  # L = |m L0|
        pe.w1.copy_(torch.tensor([1.0, 2.0, -1.0]))
        pe.b1.copy_(torch.tensor([0.0, -1.0, 1.0]))
        pe.w2.copy_(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, -3.0]]))
        pe.b2.copy_(torch.tensor([0.5, 0.0]))


def by_hand(i: int, j: int, c: float, threshold: float) -> tuple[float, float]:
    """(head 0, head 1) bias of the query at i on the key at j, from the paper's formula."""
    x = math.log(c * (i - j) + 1) / math.log(c * max(threshold, i) + 1)
    relu = lambda v: max(v, 0.0)  # noqa: E731
    return relu(x) + relu(2 * x - 1) + 0.5, -3 * relu(1 - x)


@fidelity(
    "`pos_encoding: fire`",
    paper="Li et al. 2024",
    code="the authors' PyTorch `FIRE` module (in the paper)",
    default=(
        "f(ψ(i − j)/ψ(max(L, i))), ψ(x) = ln(|c|x + 1), width 32, c = 0.1, L = |m·L₀|, one bias for all layers (FIRE-S)"
    ),
    deviations="per-layer FIRE: `fire_per_layer`; L₀ = block_size/4 (theirs 512 for 2048 tokens; no option)",
)
def test_the_bias_is_an_mlp_of_log_distance_over_log_position():
    model = GPT(CONFIG)
    _set(model, c=0.5, threshold=4.0)
    pe = model.pe
    for i, j in [(0, 0), (3, 1), (3, 0), (10, 2), (10, 9), (40, 0)]:  # below and beyond L = 4
        query, distance = torch.tensor(i), torch.tensor(i - j)
        got = [pe.bias().formula(torch.tensor(h), distance, query).item() for h in (0, 1)]
        assert got == pytest.approx(by_hand(i, j, 0.5, 4.0), rel=1e-5, abs=1e-6), (i, j)
    # the input stays in [0, 1] at any length: the first key of a query far beyond training is at 1 (head 1: -3 (1 - x))
    far = 1 + pe.bias().formula(torch.tensor(1), torch.tensor([0, 5000, 9999]), torch.tensor(9999)) / 3
    assert far.tolist() == pytest.approx([0.0, math.log(2501) / math.log(5000.5), 1.0], rel=1e-5)


def test_c_and_l_are_used_positive_and_a_masked_key_stays_finite():
    model = GPT(CONFIG)
    _set(model, c=-0.5, threshold=-4.0)
    bias = model.pe.bias().formula(torch.tensor(0), torch.tensor(7), torch.tensor(10))
    assert bias.item() == pytest.approx(by_hand(10, 3, 0.5, 4.0)[0], rel=1e-5)
    assert model.pe.bias().formula(torch.tensor(1), torch.tensor(-3), torch.tensor(2)).isfinite()


def test_the_attention_weights_are_the_softmax_of_scores_plus_the_bias_by_hand():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    _set(model, c=0.3, threshold=2.0)
    T = 6
    idx = torch.randint(0, 64, (1, T))
    seen = []
    with torch.no_grad():
        model.attention_weights(idx, lambda layer: (lambda rows, w: seen.append(w)) if layer == 0 else None)
        h = model.blocks[0].ln_1(model.wte(idx))  # FIRE adds nothing to the embeddings
        q, k, _ = model.blocks[0].attn.qkv(h).split(16, dim=-1)
    q, k = (t.view(1, T, 2, 8).transpose(1, 2) for t in (q, k))
    bias = torch.full((2, T, T), float("-inf"))
    for i in range(T):
        for j in range(i + 1):
            bias[:, i, j] = torch.tensor(by_hand(i, j, 0.3, 2.0))
    scores = q @ k.transpose(-2, -1) / math.sqrt(8) + bias
    torch.testing.assert_close(torch.cat(seen, dim=2), scores.softmax(-1), rtol=1e-5, atol=1e-6)


def test_every_fire_parameter_gets_the_same_gradient_on_eager_and_sdpa():
    grads = scheme_gradients(dataclasses.replace(CONFIG, n_layer=2), 39)  # past block_size and L: both regimes
    assert set(grads[0]) == {"c", "threshold_scale", "w1", "b1", "w2", "b2"}
    for name, eager in grads[0].items():
        assert eager is not None and eager.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], eager, rtol=1e-4, atol=1e-6, msg=name)


def test_the_flex_score_mod_is_the_dense_bias():
    from posgpt.model.kernels import KERNELS, Placement
    from posgpt.model.kernels.flex import score_mod_of
    from posgpt.model.masks import AttentionMask

    model = GPT(CONFIG)
    pe, n_head, q_len, k_len = model.pe, CONFIG.n_head, 5, 30
    # the last 5 of 30 positions, over all 30 keys: as decoding through a cache puts them
    positions, k_pos = torch.arange(k_len - q_len, k_len)[None], torch.arange(k_len)[None]
    step = Placement(q_len, n_head, torch.device("cpu"), positions, k_pos)
    _, bias = KERNELS["eager"].context(pe.bias(), AttentionMask(), step, {}).block(slice(0, q_len))
    h, q_idx, kv_idx = torch.arange(n_head)[:, None, None], torch.arange(q_len)[None, :, None], torch.arange(k_len)
    score_mod = score_mod_of(pe.bias(), step)
    modded = score_mod(torch.zeros(n_head, q_len, k_len), torch.tensor(0), h, q_idx, kv_idx[None, None])
    visible = bias[0] > float("-inf")
    with torch.no_grad():
        torch.testing.assert_close(modded[visible], bias[0][visible])


def test_a_checkpoint_round_trips_every_fire_parameter(tmp_path):
    model = GPT(CONFIG)
    _set(model, c=0.7, threshold=3.0)
    torch.save({"config": CONFIG.to_dict(), "state": model.state_dict()}, tmp_path / "f.pt")
    saved = torch.load(tmp_path / "f.pt")
    again = GPT(GPTConfig.from_dict(saved["config"]))
    again.load_state_dict(saved["state"])
    assert again.pe.c.item() == pytest.approx(0.7)
    assert (again.pe.threshold_scale * again.pe.initial_threshold).item() == pytest.approx(3.0)  # L = |m L0|
    idx = torch.randint(0, 64, (1, 24))
    torch.testing.assert_close(again(idx)[0], model(idx)[0])


def test_fire_starts_at_c_0_1_and_l_a_quarter_of_the_block_and_refuses_a_bad_width():
    pe = GPT(dataclasses.replace(CONFIG, block_size=64)).pe
    assert pe.c.item() == pytest.approx(0.1) and pe.threshold_scale.item() == 1.0  # L = |m L0| = 16
    assert pe.initial_threshold.item() == 16.0
    assert pe.w1.numel() == 3
    with pytest.raises(ConfigError, match="fire_width must be a positive integer"):
        dataclasses.replace(CONFIG, fire_width=0)
    with pytest.raises(ConfigError, match="pos_encoding='fire'"):
        dataclasses.replace(CONFIG, attention="linear")  # linear attention's kernels take no score bias


PER_LAYER = dataclasses.replace(CONFIG, n_layer=2, fire_per_layer=True)


def test_per_layer_each_layer_has_its_own_c_l_and_mlp():
    model = GPT(PER_LAYER)
    pe = model.pe
    assert pe.c.shape == (2,) and pe.w1.shape == (6,) and pe.w2.shape == (3, 4) and pe.b2.shape == (4,)
    with torch.no_grad():
        pe.c.copy_(torch.tensor([0.5, 0.2]))
        pe.threshold_scale.copy_(torch.tensor([4.0, 2.0]) / pe.initial_threshold)
        pe.w1.copy_(torch.tensor([1.0, 2.0, -1.0, 0.5, 0.0, 3.0]))  # layer 0's units, then layer 1's
        pe.b1.copy_(torch.tensor([0.0, -1.0, 1.0, 0.1, 0.0, -0.5]))
        pe.w2.copy_(torch.tensor([[1.0, 0.0, 2.0, 0.0], [1.0, 0.0, 0.0, 1.0], [0.0, -3.0, 1.0, 1.0]]))
        pe.b2.copy_(torch.tensor([0.5, 0.0, -0.2, 0.3]))
    relu = lambda v: max(v, 0.0)  # noqa: E731
    i, j = 10, 3
    x = math.log(0.2 * 7 + 1) / math.log(0.2 * 10 + 1)  # layer 1: c = 0.2, L = 2
    hidden = [relu(0.5 * x + 0.1), relu(0.0), relu(3 * x - 0.5)]
    expected = [2 * hidden[0] + hidden[2] - 0.2, hidden[1] + hidden[2] + 0.3]  # outputs 2, 3
    got = [pe.bias(1).formula(torch.tensor(h), torch.tensor(i - j), torch.tensor(i)).item() for h in (0, 1)]
    assert got == pytest.approx(expected, rel=1e-5)
    assert pe.bias(0).formula(torch.tensor(0), torch.tensor(7), torch.tensor(10)).item() == pytest.approx(
        by_hand(10, 3, 0.5, 4.0)[0], rel=1e-5
    )  # layer 0: the shared test's values


def test_per_layer_the_layers_biases_reach_their_kernels_and_gradients_agree():
    grads, logits = [], []
    for backend in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(PER_LAYER, attn_backend=backend))
        idx = torch.randint(0, 64, (2, 40))
        out, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        logits.append(out.detach())
        grads.append({name: p.grad for name, p in model.pe.named_parameters()})
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    assert (grads[0]["c"] != 0).all() and (grads[0]["w1"].view(2, -1).abs().sum(-1) > 0).all()  # each layer
    for name, eager in grads[0].items():
        assert eager.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], eager, rtol=1e-4, atol=1e-6, msg=name)
    # the second layer's bias is its own: the same model with layer 1's MLP zeroed gives other logits
    model = GPT(PER_LAYER).eval()
    idx = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        before = model(idx)[0]
        model.pe.w2[:, 2:].zero_()
        assert not torch.allclose(model(idx)[0], before)


def test_per_layer_flex_matches_eager(monkeypatch):
    uncompiled_flex(monkeypatch)  # compiled flex is refused on a CPU (model/kernels/flex.py); test_gpu.py compiles it
    assert_flex_matches_eager(PER_LAYER, 30)


def test_per_layer_cached_decoding_gives_the_tokens_of_no_cache():
    torch.manual_seed(0)
    model = GPT(PER_LAYER).eval()
    prompt = torch.randint(0, 64, (2, 5))
    cached, uncached = (model.generate(prompt, 25, temperature=0, use_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached)


def test_per_layer_with_one_layer_gives_scalar_biases_and_no_weight_decay_on_the_first_layer():
    pe = GPT(dataclasses.replace(CONFIG, n_layer=1, fire_per_layer=True)).pe
    assert pe.bias().formula(torch.tensor(1), torch.tensor(3), torch.tensor(5)).shape == ()
    assert pe.w1.dim() == pe.b1.dim() == 1  # 1-D as in the shared form: AdamW decays neither
