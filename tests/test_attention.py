"""Attention kernels: causality for every scheme x backend, and sdpa / flex against the eager reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import POS_ENCODINGS, GPTConfig
from model.kernels import causal_mask, choose_kernel, eager_attention, needs_of, sdpa_attention
from model.masks import AttentionMask
from model.positions import build_positions

from helpers import build, eager_with_weights, lengths, run_pair

BACKENDS = ("eager", "sdpa", "flex")
ODD_LEN = 13  # not a multiple of 16 (FlexAttention's and the flash kernels' tile sizes)


def _marks(backend: str) -> list[pytest.MarkDecorator]:
    # FlexAttention compiles on first use for each new shape (seconds each on CPU).
    return [pytest.mark.slow] if backend == "flex" else []


SCHEME_X_BACKEND = [
    pytest.param(scheme, backend, marks=_marks(backend), id=f"{scheme}-{backend}")
    for backend in BACKENDS
    for scheme in POS_ENCODINGS
]


@pytest.mark.parametrize(("scheme", "backend"), SCHEME_X_BACKEND)
def test_future_tokens_never_change_past_logits(tiny_config, scheme, backend):
    model = build(tiny_config, scheme, backend).eval()
    vocab = tiny_config.vocab_size
    # flex compiles a kernel per shape (seconds on a CPU): one length here, both in the parity test
    for T in lengths(model.config, ODD_LEN) if backend != "flex" else [ODD_LEN]:
        idx = torch.randint(0, vocab, (2, T))
        for t in (1, T // 2, T - 1):
            changed = idx.clone()
            shift = torch.randint(1, vocab, idx[:, t:].shape)  # every token from t on differs
            changed[:, t:] = (idx[:, t:] + shift) % vocab
            with torch.no_grad():
                before, _ = model(idx)
                after, _ = model(changed)
            torch.testing.assert_close(after[:, :t], before[:, :t], atol=1e-5, rtol=1e-5)
            # the change is visible from position t on, so the test can fail
            assert (after[:, t:] - before[:, t:]).abs().max() > 1e-3


def assert_matches_eager(config: GPTConfig, scheme: str, backend: str) -> None:
    """Same weights and input: `backend` gives the float32 eager reference's logits, and its
    gradients where the backend has a backward pass on CPU, at an odd length and 4 x block_size."""
    for T, (ref_logits, ref_grads), (logits, grads) in run_pair(
        config, scheme, backend, torch.device("cpu"), torch.float32, ODD_LEN
    ):
        torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4, msg=f"logits, T={T}")
        if ref_grads is not None:
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], atol=2e-5, rtol=1e-4, msg=f"{name}, T={T}")
        else:
            assert backend == "flex"  # the only kernel without a CPU backward pass


@pytest.mark.parametrize("scheme", POS_ENCODINGS)
def test_sdpa_matches_eager_in_float32(tiny_config, scheme):
    assert_matches_eager(tiny_config, scheme, "sdpa")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", POS_ENCODINGS)
def test_flex_matches_eager_in_float32(tiny_config, scheme):
    assert_matches_eager(tiny_config, scheme, "flex")


def test_eager_reference_is_softmax_of_masked_scores():
    q, k, v = torch.randn(3, 2, 3, 6, 4, dtype=torch.float64).unbind(0)  # (B, H, T, D)
    bias = torch.randn(3, 6, 6, dtype=torch.float64)
    out, weights = eager_with_weights(q, k, v, bias=bias)
    mask = causal_mask(6, 6)
    assert torch.all(weights[..., ~mask] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64))
    # by hand, one row: query 4 of batch 1, head 2 sees keys 0..4
    scores = q[1, 2, 4] @ k[1, 2, :5].T / 2.0 + bias[2, 4, :5]
    torch.testing.assert_close(out[1, 2, 4], torch.softmax(scores, -1) @ v[1, 2, :5])


def test_sdpa_with_a_cache_shaped_query_matches_eager():
    """Queries that are the last Tq of Tk positions (KV-cache decoding): 1 query, and a chunk of 5."""
    k, v = torch.randn(2, 2, 3, 12, 8).unbind(0)
    for q_len in (1, 5):
        q = torch.randn(2, 3, q_len, 8)
        torch.testing.assert_close(sdpa_attention(q, k, v), eager_attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("scheme", "device", "dropout_active", "expected"),
    [
        ("alibi", "cpu", False, "sdpa"),
        ("alibi", "cuda", False, "flex"),
        ("alibi", "cuda", True, "sdpa"),
        ("rope", "cuda", False, "sdpa"),
        ("learned", "cpu", True, "sdpa"),
        ("none", "cpu", False, "sdpa"),
    ],
)
def test_auto_picks_the_fused_kernel_and_never_flex_on_cpu(tiny_config, scheme, device, dropout_active, expected):
    pe = build_positions(dataclasses.replace(tiny_config, pos_encoding=scheme))
    for needs_grad in (True, False):
        needs = needs_of(pe, AttentionMask(), torch.device(device), dropout_active, needs_grad, decoding=False)
        assert choose_kernel("auto", needs, torch.device(device)).name == expected


def test_explicit_flex_with_gradients_on_cpu_fails_clearly(tiny_config):
    model = build(tiny_config, "alibi", "flex").train()
    idx = torch.randint(0, 64, (1, 8))
    with pytest.raises(RuntimeError, match="flex.*lacks a backward pass on cpu.*Kernels that can: eager, sdpa"):
        model(idx, idx)


def test_auto_trains_alibi_on_cpu(tiny_config):
    model = build(tiny_config, "alibi", "auto").train()
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_sdpa_under_cpu_bf16_autocast_attends_in_float32_and_matches_the_reference(tiny_config, scheme, monkeypatch):
    """bf16 training on a CPU: the projections run in bf16, the fused attention in float32 (its bf16
    kernel is the slower one there); logits and gradients stay close to the float32 reference."""
    import model.kernels as attention

    seen: list[torch.dtype] = []
    real = attention.F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    for T, (ref_logits, ref_grads), (logits, grads) in run_pair(
        tiny_config, scheme, "sdpa", torch.device("cpu"), torch.bfloat16, ODD_LEN
    ):
        assert seen and set(seen) == {torch.float32}, f"T={T}"
        seen.clear()
        assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < 2e-2, f"logits, T={T}"
        for name, grad in grads.items():
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0)
            assert cosine > 0.98, f"gradient of {name}, T={T}: cosine {cosine:.4f}"
