"""fla's kernels against posgpt's own, run by tests/test_fla.py in a process of their own under Triton's interpreter
(`TRITON_INTERPRET=1`, set before Triton loads; each autotuner keeps its first configuration, which the interpreter
cannot time; the delta rule's loops yield indices with a `.to`): outputs and gradients in float32, with a window
where the function takes one, and a compiled model on fla's path in one graph."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_fla.py, under Triton's interpreter"
import builtins  # noqa: E402

from triton.runtime import autotuner  # noqa: E402

_init = autotuner.Autotuner.__init__
autotuner.Autotuner.__init__ = lambda self, fn, names, configs, *a, **k: _init(self, fn, names, configs[:1], *a, **k)

import fla.ops.common.chunk_delta_h as chunk_delta_h  # noqa: E402  (after the patch: its autotuners are made here)


class _Index(int):
    """A loop index the interpreter hands a kernel that calls `.to` on it (fla's chunk_delta_h), as compiled
    Triton's are tensors."""

    def to(self, *args: object, **kwargs: object) -> _Index:
        return self


chunk_delta_h.range = lambda *args: (_Index(i) for i in builtins.range(*args))  # its loops' `range`, not Python's

from posgpt.model import GPT, GPTConfig  # noqa: E402

CASES = [  # (attention, its settings, the kernel it is held to)
    ("forgetting", {"pos_encoding": "rope"}, "sdpa"),
    ("forgetting", {"pos_encoding": "none", "attn_window": 24}, "sdpa"),
    ("stick_breaking", {"sb_remainder": "current"}, "eager"),  # the stick left over: its gradient too
]


def _config(attention: str, **settings) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=80, n_layer=1, n_head=2, n_embd=64, dropout=0.0, attention=attention,
                     attn_backend="fla", **{"pos_encoding": "none", **settings})  # fmt: skip


@pytest.mark.parametrize(("attention", "settings", "reference"), CASES)
def test_fla_equals_posgpts_kernel_in_outputs_and_gradients(attention, settings, reference):
    torch.manual_seed(0)
    fla = GPT(_config(attention, **settings))
    ours = GPT(dataclasses.replace(fla.config, attn_backend=reference))
    ours.load_state_dict(fla.state_dict())
    idx = torch.randint(0, 64, (2, 80))  # past one of fla's 64-token blocks, not a multiple of it
    (logits, loss), (expected, loss_ours) = fla(idx, idx), ours(idx, idx)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    (loss + logits.square().mean()).backward()
    (loss_ours + expected.square().mean()).backward()
    for (name, p), q in zip(fla.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_compiled_model_on_fla_is_one_graph():
    """Every op, forward and backward, in one compiled model (a layer of FoX, stick-breaking and Gated DeltaNet)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kinds = {"fox": {"attention": "forgetting"}, "sb": {"attention": "stick_breaking"},
             "gdn": {"attention": "gated_deltanet"}}  # fmt: skip
    config = dataclasses.replace(_config("forgetting"), block_size=32, n_layer=3, layout=tuple(kinds), kinds=kinds)
    model = GPT(config)
    model.compile(backend="aot_eager", fullgraph=True)  # a graph break would raise
    idx = torch.randint(0, 64, (2, 32))
    model(idx, idx)[1].backward()
    assert not counters["graph_break"] and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("attention", "heads", "length"), [("gated_deltanet", 2, 72), ("kda", 1, 24)])
def test_fla_delta_rule_equals_the_chunked_form(attention, heads, length):
    """Gated DeltaNet's and KDA's chunk kernels against posgpt's chunked form: outputs, final state and every gradient,
    float32, from zeros as in training (fla's kernel never decodes) and, for GDN, past one chunk. KDA's kernels are
    the slowest under the interpreter: one head, part of a chunk."""
    from posgpt.model.attention.delta import DeltaChunked
    from posgpt.model.kernels.fla import FlaDelta

    torch.manual_seed(0)
    B, H, T, d_k, d_v = 1, heads, length, 16, 24
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, d_k), dim=-1) for _ in range(2))
    q = q / d_k**0.5
    v, beta = torch.randn(B, H, T, d_v), torch.rand(B, H, T)
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, 1 if attention == "gated_deltanet" else d_k)) * 0.3
    given = [t.clone().requires_grad_() for t in (q, k, v, beta, g)]
    ours = [t.detach().clone().requires_grad_() for t in given]
    results = [FlaDelta.rule(*given), DeltaChunked.rule(*ours)]
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for out, final in results:
        (out.square().sum() + final.sum()).backward()
    for a, b in zip(given, ours, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
