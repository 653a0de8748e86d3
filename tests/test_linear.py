"""oneDNN's linear layers for CPU decoding (model/linear.py): the same numbers as `F.linear` to float32 rounding,
`F.linear` itself wherever a gradient, another dtype or a compiled graph is asked for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posgpt.model import GPT, GPTConfig, linear
from posgpt.model.linear import OneDnnLinear, onednn_linears

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_gives_f_linear_to_float32_rounding_and_defers_to_it_for_gradients(bias, monkeypatch):
    layer = nn.Linear(48, 96, bias=bias)
    ours = OneDnnLinear(48, 96, bias=bias)
    ours.load_state_dict(layer.state_dict())
    x = torch.randn(3, 5, 48)
    calls = []
    kernel = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or kernel(*a))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), layer(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(x[0, 0]), layer(x[0, 0]), rtol=1e-5, atol=1e-5)  # one vector
        assert torch.equal(ours.double()(x.double()), layer.double()(x.double()))  # float64: F.linear's
    assert calls == [(15, 48), (1, 48)]  # oneDNN's, for float32 without gradients only
    ours.float(), layer.float()
    assert torch.equal(ours(x), layer(x))  # with gradients: F.linear's, which has a backward
    ours(x).sum().backward()
    assert ours.weight.grad is not None and len(calls) == 2


@needs_onednn
def test_a_model_moved_to_onednn_keeps_its_state_and_logits(monkeypatch):
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True)
    model = GPT(config).eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        before, state = model(idx)[0], {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(linear, "onednn_preferred", lambda: False)
    assert not onednn_linears(model) and not any(isinstance(m, OneDnnLinear) for m in model.modules())
    monkeypatch.setattr(linear, "onednn_preferred", lambda: True)
    assert onednn_linears(model)
    moved = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert moved and all(type(m) is OneDnnLinear for m in moved)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], before, rtol=1e-4, atol=1e-5)
