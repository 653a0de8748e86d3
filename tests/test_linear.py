"""The oneDNN path of the linear layers (model/linear.py) against F.linear: values and gradients
of the layer and of a whole model, float32 on the CPU; where it does not apply (autocast, no
gradient needed for an input, compiled) and what `auto` picks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from core.errors import ConfigError
from model import GPT, GPTConfig
from model import linear as linear_module
from model.linear import Linear, OneDnnLinear, onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24)])
def test_onednn_linear_equals_f_linear_with_gradients(shape, bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(40, 24, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if bias else None
    grad = torch.randn(*shape[:-1], 40)
    inputs = [t for t in (x, w, b) if t is not None]
    expected = torch.autograd.grad(F.linear(x, w, b), inputs, grad)
    out = OneDnnLinear.apply(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_frozen_input_gets_no_gradient_computed(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    out = OneDnnLinear.apply(x, w, None)
    products = []
    real = linear_module._onednn
    monkeypatch.setattr(linear_module, "_onednn", lambda *args: products.append(args) or real(*args))
    (gw,) = torch.autograd.grad(out.sum(), [w])
    torch.testing.assert_close(gw, torch.ones(4, 6).t() @ x)
    assert len(products) == 1  # the weight's gradient only: no product for the input's


def test_compiled_code_sees_f_linear(monkeypatch):
    monkeypatch.setattr(OneDnnLinear, "apply", lambda *args: pytest.fail("oneDNN inside a compiled graph"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # what Dynamo answers while tracing
    layer = Linear(8, 4, backend="onednn")
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_model_on_onednn_trains_as_on_aten():
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=True, dropout=0.1)
    models = []
    for backend in ("aten", "onednn"):
        torch.manual_seed(0)
        models.append(GPT(dataclasses.replace(config, linear_backend=backend)))
    assert models[1].blocks[0].attn.qkv.onednn and not models[0].blocks[0].attn.qkv.onednn
    assert list(models[0].state_dict()) == list(models[1].state_dict())
    idx = torch.randint(0, 64, (3, 33))
    results = []
    for model in models:
        torch.manual_seed(1)  # dropout's masks
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_onednn_steps_aside_under_autocast_and_for_other_dtypes(monkeypatch):
    calls = []
    monkeypatch.setattr(OneDnnLinear, "apply", lambda *args: calls.append(args) or F.linear(*args))
    layer = Linear(8, 4, backend="onednn")
    x = torch.randn(2, 8)
    layer(x)
    assert len(calls) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast's own bf16 matmul
    layer.to(torch.float64)(x.double())
    assert len(calls) == 1


def test_auto_picks_onednn_only_on_non_intel_avx512(monkeypatch, tmp_path):
    def machine(vendor: str, capability: str) -> bool:
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu\n")
        monkeypatch.setattr(linear_module, "Path", lambda _: cpuinfo)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        linear_module.onednn_preferred.cache_clear()
        try:
            return linear_module.onednn_preferred()
        finally:
            linear_module.onednn_preferred.cache_clear()

    assert machine("AuthenticAMD", "AVX512")
    assert not machine("GenuineIntel", "AVX512")
    assert not machine("AuthenticAMD", "AVX2")


def test_an_unknown_linear_backend_is_refused():
    with pytest.raises(ConfigError, match="linear_backend"):
        GPTConfig(linear_backend="mkl")
