"""Stick-breaking attention (Tan et al., ICLR 2025) against its formula written out here in float64, not from
our code: A_ij = beta_ij prod_{j<t<i} (1 - beta_it), beta = sigmoid(score), the query's own key not attended and
the remainder on its own value. The causality check (test_kernels.py) and cached = uncached decoding
(test_cache.py) take the function from the registry."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import GPT, GPTConfig
from posgpt.model.attention.stick_breaking import stick_breaking_weights

from helpers import fidelity

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False,
                   attention="stick_breaking", pos_encoding="none")  # fmt: skip


def formula_weights(scores: torch.Tensor, visible: torch.Tensor, remainder: bool) -> torch.Tensor:
    """(H, T, T) float64 weights by the paper's product, key by key, over the keys each query sees."""
    H, T, _ = scores.shape
    weights = torch.zeros(H, T, T, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            keys = [j for j in range(i) if visible[i, j]]
            for j in keys:
                beta = 1 / (1 + math.exp(-scores[h, i, j].item()))
                weights[h, i, j] = beta * math.prod(1 - 1 / (1 + math.exp(-scores[h, i, t].item())) for t in keys
                                                    if t > j)  # fmt: skip
            if remainder:
                weights[h, i, i] = 1 - weights[h, i].sum()
    return weights


def visibility(T: int, window: int = 0, sinks: int = 0) -> torch.Tensor:
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & ((window == 0) | (i - j < window) | (j < sinks))


@pytest.mark.parametrize(("fields", "remainder"), [({}, "current"), ({}, "drop"),
                                                   ({"pos_encoding": "alibi", "attn_window": 4, "attn_sinks": 1},
                                                    "current")],
                         ids=["nope", "nope-drop", "alibi-window-sinks"])  # fmt: skip
@fidelity(
    "`attention: stick_breaking`",
    paper="Tan et al. 2025",
    code=(
        "shawntan/stickbreaking-attention `sb_ref.py` (`attend_current=False`), remainder as its tests and "
        "shawntan/dolomite-engine's `sb_remainder=True`"
    ),
    default="A_ij = σ(s_ij)·Π_{j<t<i}(1 − σ(s_it)), own key not attended, 1 − Σ_j A_ij on the query's own value",
    deviations="`sb_remainder drop`: the remainder dropped",
)
def test_the_weights_of_a_model_are_the_papers_product(fields, remainder):
    """A 1-layer model's weights (the eager kernel's, as attention maps see them) against the formula over its own
    scores (q.k / sqrt(d) plus ALiBi's bias), past the training length."""
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, sb_remainder=remainder, **fields)
    model = GPT(config).eval()
    T = 21
    idx = torch.randint(0, 64, (1, T))
    seen = []
    with torch.no_grad():
        model.attention_weights(idx, lambda layer: lambda rows, w: seen.append(w))
        q, k, _ = model.blocks[0].attn.qkv(model.blocks[0].ln_1(model.wte(idx))).split(16, dim=-1)
    q, k = (t.view(T, 2, 8).transpose(0, 1).double() for t in (q, k))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    if fields:
        slopes = torch.tensor([2.0**-4, 2.0**-8], dtype=torch.float64)[:, None, None]  # ALiBi's for 2 heads
        scores = scores - slopes * (torch.arange(T)[:, None] - torch.arange(T)[None, :])
    expected = formula_weights(scores, visibility(T, config.attn_window, config.attn_sinks), remainder == "current")
    got = torch.cat(seen, dim=2)[0].double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if remainder == "current":
        torch.testing.assert_close(got.sum(-1), torch.ones(2, T, dtype=torch.float64))
    else:
        assert torch.all(got.sum(-1) < 1) and torch.all(got.diagonal(dim1=-2, dim2=-1) == 0)


@pytest.mark.parametrize(("remainder", "window"), [(True, 0), (False, 0), (True, 4)])
def test_weights_and_gradients_in_float64_against_the_formula(remainder, window):
    """The weights function alone, in float64, against the product and its gradients by autograd through it (its
    backward is written out), with and without the remainder, over all keys and a window's."""
    torch.manual_seed(1)
    T = 9
    visible = visibility(T, window)
    scores = torch.randn(2, T, T, dtype=torch.float64) * 3
    mine = scores.clone().requires_grad_(True)
    got = stick_breaking_weights(mine.masked_fill(~visible, float("-inf")), visible, remainder=remainder)
    torch.testing.assert_close(got, formula_weights(scores, visible, remainder), rtol=1e-12, atol=1e-12)

    ref = scores.clone().requires_grad_(True)
    beta, rest = torch.sigmoid(ref), torch.sigmoid(-ref)  # the product, as tensors for autograd
    expected = torch.zeros(2, T, T, dtype=torch.float64)
    for i in range(T):
        keys = [j for j in range(i) if visible[i, j]]
        for j in keys:
            expected[:, i, j] = beta[:, i, j] * torch.prod(rest[:, i, [t for t in keys if t > j]], dim=-1)
        if remainder:
            expected[:, i, i] = 1 - expected[:, i, :i].sum(-1)
    weight = torch.randn(2, T, T, dtype=torch.float64)
    (got * weight).sum().backward()
    (expected * weight).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_only_the_eager_kernel_runs_it_and_a_window_keeps_a_full_cache():
    with pytest.raises(ConfigError, match="attn_backend='sdpa' is not a kernel of attention='stick_breaking'"):
        dataclasses.replace(CONFIG, attn_backend="sdpa")
    model = GPT(dataclasses.replace(CONFIG, attn_window=4))
    assert type(model.kernel(torch.device("cpu"), False, True)).__name__ == "StickBreakingEager"
    assert not model.new_cache(32).parts[0].rolling  # the product runs over keys in position order
