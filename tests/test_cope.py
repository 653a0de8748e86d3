"""CoPE (Golovneva et al. 2024) against its formula written out here in float64, not from our code: gates
g_ij = sigmoid(q_i.k_j / sqrt(d)), p_ij = min(sum_{t=j..i} g_it, P - 1), the logit q_i.e interpolated between
floor(p) and ceil(p) and added to the score (divided by sqrt(d) or not). The causality check (test_kernels.py)
and cached = uncached decoding (test_cache.py) take the scheme from the registry."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import GPT, GPTConfig

from helpers import assert_model_is_its_formula, fidelity

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=True, pos_encoding="cope")


def formula_head(model: GPT, window: int = 0):
    """Query i's output in head h by CoPE's formula, key by key."""
    table, last, D = model.pe.table[0], model.pe.table.size(-1) - 1, model.config.head_dim
    scale = 1 / math.sqrt(D) if model.config.cope_divide else 1.0

    def head(b, i, h, q, k, v, hidden):
        keys = [j for j in range(i + 1) if not window or i - j < window]
        z = {j: q[b, i, h] @ k[b, j, h] / math.sqrt(D) for j in keys}
        logits = []
        for j in keys:
            p = torch.clamp(sum(torch.sigmoid(z[t]) for t in keys if t >= j), max=last)
            low, high = int(math.floor(p.item())), int(math.ceil(p.item()))
            w = p - low
            position = (1 - w) * (q[b, i, h] @ table[:, low]) + w * (q[b, i, h] @ table[:, high])
            logits.append(z[j] + scale * position)
        return torch.softmax(torch.stack(logits), 0) @ v[b, keys, h]

    return head


@pytest.mark.parametrize("fields", [{}, {"cope_divide": False, "cope_positions": 4}, {"attn_window": 5}],
                         ids=["divided", "undivided-clamped", "window"])  # fmt: skip
@fidelity(
    "`pos_encoding: cope`",
    paper="Golovneva et al. 2024",
    code="facebookresearch/RAM projects/cope `ContextPosSelfAttn`",
    default=(
        "gates σ(q·k/√d) over the visible keys, p_ij = Σ_{t=j..i} g_it clamped to P − 1, P = block_size + 1, tables "
        "(D, P) per layer shared by the heads, zeros at the start, the term divided by √d with q·k (their "
        "`--cope-nodiv` off)"
    ),
    deviations=(
        "`cope_divide false`: the paper's appendix code (term undivided); the gates always from the scaled score; "
        "their separate gate keys and value gates not offered"
    ),
)
def test_logits_and_gradients_in_float64_are_the_formulas(fields):
    """Past the training length, with the table drawn (it starts at zero), on the eager kernel (the only one)."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, **fields)).double()
    with torch.no_grad():
        model.pe.table.normal_(0.0, 1.0)
    idx = torch.randint(0, 64, (1, 19))
    window = model.config.attn_window
    grads = assert_model_is_its_formula(model, idx, formula_head(model, window))
    assert grads["pe.table"].abs().sum() > 0


def test_its_needs_are_declared_and_the_table_starts_at_zero():
    model = GPT(CONFIG)
    assert model.pe.table.shape == (1, 8, 17) and torch.all(model.pe.table == 0)  # P = block_size + 1
    assert type(model.kernel(torch.device("cpu"), False, True)).__name__ == "SoftmaxEager"
    with pytest.raises(ConfigError, match="cannot run pos_encoding='cope': kernel 'sdpa' lacks positions computed"):
        dataclasses.replace(CONFIG, attn_backend="sdpa")
    with pytest.raises(ConfigError, match="attention='differential' scores half-heads, and pos_encoding='cope'"):
        dataclasses.replace(CONFIG, attention="differential")
    assert not GPT(dataclasses.replace(CONFIG, attn_window=4)).new_cache(32).parts[0].rolling  # keys in position order
