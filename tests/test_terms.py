"""The kinds of score terms (model/terms.py) as the kernels run them: a transform of the scores (Gemma 2's
soft-cap) and softmax mass with no key (gpt-oss's sink logits), against a float64 formula written from their
definitions, in the documented order (the cap on the score, before a position bias); and every kernel that does not
declare a kind refuses it in its words."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.model import ATTENTIONS
from posgpt.model.kernels import KERNELS, KernelError, Needs, Placement, Plan
from posgpt.model.kernels.eager import softmax_weights
from posgpt.model.masks import AttentionMask
from posgpt.model.positions import alibi_slopes
from posgpt.model.scores import ScaledDot
from posgpt.model.terms import ScoreBias, Term

from helpers import fidelity, uncompiled_flex
from test_kernels import TINY

B, H, T, D, CAP, WINDOW = 2, 4, 11, 8, 2.0, 6


def softcap(scores: torch.Tensor) -> torch.Tensor:
    return CAP * torch.tanh(scores / CAP)


def formula(q, k, v, sinks: torch.Tensor, cap_first: bool = True) -> torch.Tensor:
    """Query i over keys j in (i - W, i]: s = q.k / sqrt(D); the soft-cap c tanh(s / c) of the score, then ALiBi's
    -m_h (i - j); weights exp(s_ij) / (exp(z_h) + sum_j exp(s_ij)), the sink z_h taking its share; key by key."""
    slopes = alibi_slopes(H)
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b, h, i in ((b, h, i) for b in range(B) for h in range(H) for i in range(T)):
        keys = range(max(0, i - WINDOW + 1), i + 1)
        scores = []
        for j in keys:
            s = q[b, h, i] @ k[b, h, j] / math.sqrt(D)
            bias = -slopes[h] * (i - j)
            scores.append(CAP * torch.tanh(s / CAP) + bias if cap_first else CAP * torch.tanh((s + bias) / CAP))
        scores = torch.stack(scores)
        weights = torch.exp(scores) / (torch.exp(sinks[h]) + torch.exp(scores).sum())
        out[b, h, i] = weights @ v[b, h, list(keys)]
    return out


def attend(kernel_name: str, q, k, v, sinks: torch.Tensor, on_weights=None) -> torch.Tensor:
    """Softmax attention through one of its kernels, with ALiBi's bias, a window, the soft-cap and the sinks."""
    kernel, (_, heads, length, dim) = KERNELS[kernel_name], q.shape
    slopes = torch.tensor(alibi_slopes(heads), dtype=q.dtype, device=q.device)
    bias = ScoreBias(lambda h, distance, query: -slopes[h] * distance, heads)
    placement = Placement(length, heads, q.device)
    context = kernel.context(bias, AttentionMask(window=WINDOW), placement, {})
    plan = Plan(kernel, context, placement, on_weights, transform=softcap, sinks=sinks)
    return plan.attend(q, k, v, ScaledDot(dim), 0.0)


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    q, k, v = (3 * torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))  # scores past the cap
    return q, k, v, torch.randn(H, dtype=torch.float64, requires_grad=True)


@fidelity("`attn_sink_logits`")
@fidelity("`attn_softcap`")
def test_the_eager_kernel_is_the_formula_with_its_gradients(inputs):
    q, k, v, sinks = inputs
    weight = torch.randn(B, H, T, D, dtype=torch.float64)
    rows = []
    got = attend("eager", q, k, v, sinks, on_weights=lambda r, w: rows.append(w))
    (got * weight).sum().backward()
    grad, sinks.grad = sinks.grad, None
    expected = formula(q, k, v, sinks)
    (expected * weight).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, sinks.grad, rtol=1e-9, atol=1e-10)
    assert not torch.allclose(expected, formula(q, k, v, sinks, cap_first=False))  # the order is what is tested
    mass = torch.cat(rows, dim=2).sum(-1)  # the weights a map shows: the sinks' share left out
    assert bool((mass < 1).all()) and bool((mass > 0).all())


def test_flex_runs_the_transform_and_the_mass_as_eager_does(inputs, monkeypatch):
    """FlexAttention's score_mod caps the score before the bias; the sinks rescale its output by its log-sum-exp
    (uncompiled on a CPU, forward only: compiled, with gradients, on CUDA below)."""
    uncompiled_flex(monkeypatch)
    q, k, v, sinks = inputs
    with torch.no_grad():
        torch.testing.assert_close(attend("flex", q, k, v, sinks), attend("eager", q, k, v, sinks))


def test_every_kernel_that_declares_them_runs_them_as_its_reference(inputs, monkeypatch):
    """Each function's kernels that declare the transform or the mass (flex uncompiled, forward) against the one
    that forms its weights, with the same terms (softmax's reference is the formula above)."""
    uncompiled_flex(monkeypatch)
    q, k, v, sinks = inputs
    placement = Placement(T, H, torch.device("cpu"))
    checked = []
    for function, layer in ATTENTIONS.items():
        reference = next(kernel for kernel in layer.kernels.values() if kernel.weights)
        settings = layer.kernel_settings(dataclasses.replace(TINY, attention=function)) if layer.scored else {}
        for name, kernel in layer.kernels.items():
            kinds = kernel.terms & {Term.TRANSFORM, Term.MASS}
            assert kinds <= reference.terms, (function, name)  # what the reference does not run, none may
            if not kinds or kernel is reference:
                continue
            extra = {"transform": softcap, "sinks": sinks if Term.MASS in kinds else None}
            outs = [Plan(k_, k_.context(None, AttentionMask(window=WINDOW), placement, {}, **settings), placement,
                         **extra).attend(q, k, v, ScaledDot(D), 0.0) for k_ in (kernel, reference)]  # fmt: skip
            torch.testing.assert_close(*outs, msg=f"{function}/{name}")
            checked.append(f"{function}/{name}")
    assert "softmax/flex" in checked and "sigmoid/flex" in checked


def test_a_kernel_without_a_kind_refuses_it_in_its_words():
    cpu = torch.device("cpu")
    sdpa = Needs(terms=frozenset({Term.TRANSFORM, Term.MASS})).unmet(KERNELS["sdpa"])
    assert [lack.words for lack in sdpa] == [Term.TRANSFORM.value[0], Term.MASS.value[0]]
    needs = Needs(terms=frozenset({Term.MASS}), runs_on="cpu")
    assert ATTENTIONS["softmax"].choose_kernel("auto", needs, cpu) is KERNELS["eager"]
    for layer in ATTENTIONS.values():  # only a softmax has a normaliser to add mass to
        if not any(Term.MASS in kernel.terms for kernel in layer.kernels.values()):
            with pytest.raises(KernelError, match=r"softmax mass with no key \(sink logits\)"):
                layer.choose_kernel("auto", needs, cpu)
    for function, layer in ATTENTIONS.items():  # sink logits where the weights are a softmax, and only there
        reference = next(kernel for kernel in layer.kernels.values() if kernel.weights)
        softmax = getattr(reference, "weigh", None) is softmax_weights
        assert (Term.MASS in reference.terms) == softmax, function
    placement = Placement(T, H, cpu)  # a layer that sets a term its kernel does not run is stopped, not ignored
    plan = Plan(KERNELS["sdpa"], KERNELS["sdpa"].context(None, AttentionMask(), placement, {}), placement,
                transform=softcap)  # fmt: skip
    with pytest.raises(KernelError, match=r"SdpaKernel lacks a transform of the scores \(a soft-cap\)"):
        plan.attend(*torch.randn(3, B, H, T, D).unbind(0), ScaledDot(D), 0.0)


@pytest.mark.gpu
def test_compiled_flex_runs_the_transform_and_the_mass_with_their_gradients_on_cuda():
    """What the CPU runs uncompiled and forward only: compiled flex against eager on CUDA in float32 (flex has no
    float64 there), the gradients of q, k, v and of the sinks, through flex's log-sum-exp, included."""
    torch.manual_seed(0)
    leaves = [3 * torch.randn(B, H, 64, 16, device="cuda") for _ in range(3)] + [torch.randn(H, device="cuda")]
    grads = []
    for name in ("flex", "eager"):
        q, k, v, sinks = (x.clone().requires_grad_() for x in leaves)
        out = attend(name, q, k, v, sinks)
        (out * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        grads.append([out.detach(), q.grad, k.grad, v.grad, sinks.grad])
    for name, got, expected in zip(("out", "q", "k", "v", "sinks"), *grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)
