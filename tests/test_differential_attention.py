"""Differential attention (Ye et al., ICLR 2025) against its formula, written out here: one layer's
output and its attention map by hand (both splits), with RoPE against the official code's half-heads,
lambda_init per layer, relative positions only (a shift of every position changes nothing), the
refusals, and a checkpoint round trip. The parity matrix (test_kernels.py) and the cache tests
(test_cache.py) take it from the registry."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import GPT, GPTConfig

from helpers import fidelity

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False,
                   attention="differential", pos_encoding="alibi")  # fmt: skip


def softmax_map(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    T = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + bias
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)


@pytest.mark.parametrize(("split", "first", "second"), [("half_heads", [0, 1, 2, 3], [4, 5, 6, 7]),
                                                       ("rope_pairs", [0, 2, 4, 6], [1, 3, 5, 7])])  # fmt: skip
def test_one_layer_is_the_difference_of_two_softmax_maps_normalised_per_head_by_hand(split, first, second):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, diff_split=split)).eval()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.head_norm.weight.uniform_(0.5, 1.5)  # a gain that is not 1
    T, D = 7, 8
    idx = torch.randint(0, 64, (1, T))
    captured, maps = {}, []
    attn.register_forward_hook(lambda module, args, out: captured.update(x=args[0], out=out))
    with torch.no_grad():
        model(idx)
        model.attention_weights(idx, lambda layer: lambda rows, w: maps.append(w))
        q, k, v = (t.view(1, T, 2, D).transpose(1, 2) for t in attn.qkv(captured["x"]).split(16, dim=-1))
        # half_heads: map 1 the first half of each head, map 2 the second; rope_pairs: dimensions i and
        # i + 4 are RoPE pair i, map 1 takes the even pairs, map 2 the odd ones
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        bias = -torch.tensor([2.0**-4, 2.0**-8])[:, None, None] * (i - j)  # ALiBi, 2 heads
        w1, w2 = softmax_map(q[..., first], k[..., first], bias), softmax_map(q[..., second], k[..., second], bias)
        lq1, lk1, lq2, lk2 = attn.lambdas
        lam = math.exp(lq1 @ lk1) - math.exp(lq2 @ lk2) + 0.2  # lambda_init of the first layer: 0.8 - 0.6
        heads = (w1 - lam * w2) @ v  # (1, H, T, D)
        rms = heads.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
        heads = heads / rms * attn.head_norm.weight * (1 - 0.2)
        expected = attn.proj(heads.transpose(1, 2).reshape(1, T, 16))
    torch.testing.assert_close(captured["out"], expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.cat(maps, dim=2), w1 - lam * w2, rtol=1e-4, atol=1e-6)


def rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE of the vectors' own width d, (..., T, d), pairs (i, i + d/2) turning at theta^(-2i/d), float64."""
    T, d = x.shape[-2:]
    angles = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()), dim=-1)


@fidelity(
    "`attention: differential`",
    paper="Ye et al. 2025",
    code="microsoft/unilm `Diff-Transformer/multihead_diffattn.py`",
    default=(
        "half-heads of D/2, each rotated by RoPE built for D/2 (`diff_split: half_heads`); λ re-parametrised, λ_init "
        "by depth, RMSNorm × (1 − λ_init)"
    ),
    deviations="`diff_split rope_pairs` (before issue 33); rotary pairs (i, i + d/2), theirs (2i, 2i + 1) (no option)",
)
def test_with_rope_both_maps_are_half_heads_rotated_with_the_half_heads_frequencies():
    """The official code (microsoft/unilm, Diff-Transformer/multihead_diffattn.py) views q and k as 2H
    half-heads of d = D / 2 and applies the rotary embedding built for head_dim d to each: written out
    here in float64 (its rotary pairs dimensions 2i, 2i + 1, this one i, i + d/2: a fixed permutation of
    each half-head, that is of the projection's rows). The split before issue 33 gave map 2 frequencies
    between map 1's and fails this."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, pos_encoding="rope")).eval()
    attn = model.blocks[0].attn
    T, H, D = 9, 2, 8
    idx = torch.randint(0, 64, (1, T))
    captured = {}
    attn.register_forward_hook(lambda module, args, out: captured.update(x=args[0], out=out))
    with torch.no_grad():
        model(idx)
        q, k, v = (t.double().view(1, T, H, D) for t in attn.qkv(captured["x"]).split(16, dim=-1))
        q, k = (rotary(t.reshape(1, T, 2 * H, D // 2).transpose(1, 2)) for t in (q, k))  # (1, 2H, T, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // 2)
        w = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        w = w.view(1, H, 2, T, T)
        lq1, lk1, lq2, lk2 = (p.double() for p in attn.lambdas)
        lam = torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + 0.2
        heads = (w[:, :, 0] - lam * w[:, :, 1]) @ v.transpose(1, 2)  # (1, H, T, D)
        heads = heads / heads.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * attn.head_norm.weight.double() * 0.8
        expected = attn.proj(heads.transpose(1, 2).reshape(1, T, 16).float())
    torch.testing.assert_close(captured["out"], expected, rtol=1e-4, atol=1e-5)


@fidelity("`attention: differential`")
def test_lambda_init_follows_the_layer_depth():
    model = GPT(dataclasses.replace(CONFIG, n_layer=4))
    got = [block.attn.lambda_init for block in model.blocks]
    assert got == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * (layer - 1)) for layer in (1, 2, 3, 4)])


def test_with_rope_each_map_sees_relative_positions_only():
    """Every position shifted by 37: the same logits, which holds only if no RoPE pair is split
    between the two maps."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, pos_encoding="rope", n_layer=2)).eval()
    idx = torch.randint(0, 64, (2, 12))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        model.pe.reserve(64)
        torch.testing.assert_close(model(idx, positions=positions + 37)[0], model(idx)[0], rtol=1e-4, atol=1e-5)


def test_settings_it_cannot_run_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        dataclasses.replace(CONFIG, n_embd=12, n_head=2)  # heads of 6
    with pytest.raises(ConfigError, match="attn_score='additive' is not one"):
        dataclasses.replace(CONFIG, attn_score="additive")
    with pytest.raises(ConfigError, match="rope_partial='neox'"):
        dataclasses.replace(CONFIG, pos_encoding="rope", rope_fraction=0.5, rope_partial="neox",
                            diff_split="rope_pairs")  # fmt: skip
    dataclasses.replace(CONFIG, pos_encoding="rope", rope_fraction=0.5)  # p-RoPE keeps whole-head pairs
    dataclasses.replace(CONFIG, pos_encoding="rope", rope_fraction=0.5, rope_partial="neox")  # of each half-head


def test_a_checkpoint_round_trips_lambda_and_the_head_norm(tmp_path):
    model = GPT(dataclasses.replace(CONFIG, n_layer=2))
    with torch.no_grad():
        model.blocks[1].attn.lambdas[2].fill_(0.3)
        model.blocks[1].attn.head_norm.weight.fill_(1.7)
    torch.save({"config": model.config.to_dict(), "state": model.state_dict()}, tmp_path / "d.pt")
    saved = torch.load(tmp_path / "d.pt")
    again = GPT(GPTConfig.from_dict(saved["config"]))
    again.load_state_dict(saved["state"])
    assert again.blocks[1].attn.weight().item() == pytest.approx(model.blocks[1].attn.weight().item())
    idx = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(again(idx)[0], model(idx)[0])


def test_the_flop_count_has_two_weighted_sums_of_the_values():
    softmax = GPT(dataclasses.replace(CONFIG, attention="softmax"))
    differential = GPT(CONFIG)
    extra = differential.num_params() - softmax.num_params()  # lambda vectors and the head norm's gain
    assert extra == 4 * 4 + 8
    T, C = 16, CONFIG.n_embd
    assert differential.flops_per_token(T) - softmax.flops_per_token(T) == 6 * extra + 6 * CONFIG.n_layer * C * T
