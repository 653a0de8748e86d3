"""Forgetting attention (FoX; Lin et al., ICLR 2025) against its formula written out here in float64, not from
our code: score_ij = q_i.k_j / sqrt(d) + sum_{l=j+1..i} ln sigmoid(w.x_l + b). The parity matrix and the
causality check (test_kernels.py: SDPA and flex against eager, gradients on SDPA) and cached = uncached
decoding (test_cache.py) take the function from the registry."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from posgpt.model import GPT, GPTConfig

from helpers import assert_model_is_its_formula, fidelity

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=True, attention="forgetting",
                   pos_encoding="none")  # fmt: skip


def formula_head(model: GPT):
    """Query i's output in head h by FoX's formula, key by key: the gates of the tokens after the key, up to and
    with the query's own."""
    D = model.config.head_dim

    def head(b, i, h, q, k, v, hidden):
        log_f = F.logsigmoid(model.blocks[0].attn.fgate(hidden[b]))  # (T, H): each token's gate
        scores = torch.stack([q[b, i, h] @ k[b, j, h] / math.sqrt(D) + log_f[j + 1 : i + 1, h].sum()
                              for j in range(i + 1)])  # fmt: skip
        return torch.softmax(scores, 0) @ v[b, : i + 1, h]

    return head


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@fidelity(
    "`attention: forgetting`",
    paper="Lin et al. 2025 (FoX)",
    code="zhixuan-lin/forgetting-transformer `ForgettingAttentionLayer` (`fgate_type: full`, `use_rope: false`)",
    default="q·k/√d + Σ_{l=j+1..i} ln σ(w·x_l + b) per head; gate weight N(0, 0.02), bias 0; sums in float32",
    deviations="the Pro options (output gate, QK-norm, KV-shift) not offered",
)
def test_logits_and_gradients_in_float64_are_the_formulas(backend):
    """Past the training length, on every kernel with a backward pass on this CPU."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, attn_backend=backend)).double()
    with torch.no_grad():
        model.blocks[0].attn.fgate.bias.normal_(2.0, 1.0)  # gates of every size, not all near 0.5
    idx = torch.randint(0, 64, (2, 19))
    grads = assert_model_is_its_formula(model, idx, formula_head(model))
    assert grads["blocks.0.attn.fgate.weight"].abs().sum() > 0


def test_the_weights_in_float32_with_a_scheme_and_a_window():
    """The eager kernel's weights (attention maps) against the formula with ALiBi's bias and a window with a sink,
    to float32 rounding; the query's own gate counts, the key's does not."""
    torch.manual_seed(1)
    model = GPT(dataclasses.replace(CONFIG, pos_encoding="alibi", attn_window=5, attn_sinks=1)).eval()
    T = 11
    idx = torch.randint(0, 64, (1, T))
    seen = []
    with torch.no_grad():
        model.attention_weights(idx, lambda layer: lambda rows, w: seen.append(w))
        h = model.blocks[0].ln_1(model.wte(idx))
        q, k, _ = (t.view(T, 2, 8).double() for t in model.blocks[0].attn.qkv(h)[0].split(16, dim=-1))
        log_f = F.logsigmoid(model.blocks[0].attn.fgate(h)[0].double())  # (T, H)
    expected = torch.zeros(2, T, T, dtype=torch.float64)
    slopes = [2.0**-4, 2.0**-8]
    for hh in range(2):
        for i in range(T):
            keys = [j for j in range(i + 1) if i - j < 5 or j < 1]
            scores = torch.stack([q[i, hh] @ k[j, hh] / math.sqrt(8) - slopes[hh] * (i - j)
                                  + log_f[j + 1 : i + 1, hh].sum() for j in keys])  # fmt: skip
            expected[hh, i, keys] = torch.softmax(scores, 0)
    torch.testing.assert_close(torch.cat(seen, dim=2)[0].double(), expected, rtol=1e-5, atol=1e-6)


def test_the_gate_starts_as_the_official_code_and_is_refused_by_no_kernel():
    """fgate_proj: one output per head, weight N(0, 0.02), bias 0 (f about 0.5); the term reaches every kernel."""
    model = GPT(dataclasses.replace(CONFIG, n_embd=256, n_head=4))
    gate = model.blocks[0].attn.fgate
    assert gate.weight.shape == (4, 256) and torch.all(gate.bias == 0)
    assert abs(gate.weight.std().item() - 0.02) < 0.002
    for backend in ("eager", "sdpa", "flex"):
        dataclasses.replace(CONFIG, attn_backend=backend, attn_window=4)


def test_with_cope_and_a_window_its_cache_keeps_the_sums_in_position_order():
    """The gate sums ride in the cache beside the keys; CoPE's counts need keys in position order, so with CoPE
    the window's cache does not roll, and cached decoding is the uncached one."""
    torch.manual_seed(2)
    model = GPT(dataclasses.replace(CONFIG, n_layer=2, pos_encoding="cope", attn_window=4)).eval()
    with torch.no_grad():
        model.pe.table.normal_()
    cache = model.new_cache(8)
    assert type(cache.layers[0]).__name__ == "GateLayerCache" and not cache.parts[0].rolling
    prompt = torch.randint(0, 64, (2, 5))
    cached, uncached = (model.generate(prompt, 20, temperature=0, use_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached)
