"""fla's kernels against posgpt's own, run by tests/test_fla.py in a process of their own under Triton's interpreter
(`TRITON_INTERPRET=1`, set before Triton loads; each autotuner keeps its first configuration, which the interpreter
cannot time): outputs and gradients in float32, with a window where the function takes one, and a compiled model
on fla's path in one graph."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_fla.py, under Triton's interpreter"
from triton.runtime import autotuner  # noqa: E402

_init = autotuner.Autotuner.__init__
autotuner.Autotuner.__init__ = lambda self, fn, names, configs, *a, **k: _init(self, fn, names, configs[:1], *a, **k)

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
    """Both functions' ops, forward and backward, in one compiled model (a layer of each)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kinds = {"fox": {"attention": "forgetting"}, "sb": {"attention": "stick_breaking"}}
    config = dataclasses.replace(_config("forgetting"), block_size=32, n_layer=2, layout=("fox", "sb"), kinds=kinds)
    model = GPT(config)
    model.compile(backend="aot_eager", fullgraph=True)  # a graph break would raise
    idx = torch.randint(0, 64, (2, 32))
    model(idx, idx)[1].backward()
    assert not counters["graph_break"] and all(p.grad is not None for p in model.parameters())
