"""Training memory of every scheme and attention function, counted as the bytes autograd keeps for the backward
pass (`saved_tensors_hooks`), not as resident memory: past `RECOMPUTE_ELEMENTS` scores a dense kernel attends block
by block and forms each block again in the backward pass, so no O(T^2) activation is kept; the logits and
gradients are those of one pass (issue 50: FIRE kept 89x RoPE's peak at T = 1024)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import posgpt.model.kernels.dense as dense
from posgpt.benchmarks.memory import saved_bytes, variants
from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig

BASE = GPTConfig(vocab_size=64, block_size=96, n_layer=2, n_head=4, n_embd=64, bias=False)
T = 96


@pytest.mark.parametrize("whole", [True, False])
def test_every_scheme_and_function_keeps_at_most_twice_ropes_activations(whole, monkeypatch):
    """Recomputed, as 1024 tokens are; a mask or bias formed once for every layer (ALiBi's: no second pass), or, as
    at 2048 tokens, too large for that, each layer's blocks formed again (ALiBi kept 2.45x RoPE's when not)."""
    monkeypatch.setattr(dense, "RECOMPUTE_ELEMENTS", 0)
    if not whole:
        monkeypatch.setattr(dense, "DENSE_ELEMENTS", 4 * T * T - 1)
    rope = saved_bytes(dataclasses.replace(BASE, pos_encoding="rope"), 2, T)
    ratios = {name: saved_bytes(config, 2, T) / rope for name, config in variants(BASE).items()}
    assert max(ratios.values()) <= 2 and len(ratios) == len(SCHEMES) + len(ATTENTIONS) + 2, ratios
    assert whole or ratios["alibi"] < 1, ratios  # 1.04x at this size when each layer kept its blocks


@pytest.mark.parametrize("extra", [{"pos_encoding": "alibi"}, {"attn_window": 32}])
def test_differential_attention_with_a_mask_formed_once_keeps_no_scores(extra, monkeypatch):
    """Its wider value heads go to SDPA in halves on the masked path too, which the CPU flash kernel takes (else its
    math kernel keeps the softmax: 1.30x differential attention's own, with the mask or bias not recomputed)."""
    monkeypatch.setattr(dense, "RECOMPUTE_ELEMENTS", 0)
    plain = dataclasses.replace(BASE, attention="differential")
    assert saved_bytes(dataclasses.replace(plain, **extra), 2, T) < 1.1 * saved_bytes(plain, 2, T)


@pytest.mark.parametrize("name", sorted(variants(BASE)))
def test_recomputed_blocks_give_the_logits_and_gradients_of_one_pass(name, monkeypatch):
    """Every row, in blocks of a few rows each formed again (`model.recompute`): the learned biases on SDPA (T5's
    table read by every layer), scores-computed positions, gate sums, the eager weights of stick-breaking and sink
    logits, the delta rule's segments; differential attention's wider value heads in two halves (SDPA's flash kernel
    on a CPU takes equal heads only): the same numbers."""
    monkeypatch.setattr(dense, "CPU_BLOCK_KEY_ELEMENTS", 1 << 10)
    config = variants(BASE)[name]
    results = []
    for threshold in (dense.RECOMPUTE_ELEMENTS, 0):
        monkeypatch.setattr(dense, "RECOMPUTE_ELEMENTS", threshold)
        torch.manual_seed(0)
        model, idx = GPT(config), torch.randint(0, config.vocab_size, (2, T))
        logits, loss = model(idx, idx)
        loss.backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (logits, grads), (again, regrads) = results
    torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-6)
    assert regrads.keys() == grads.keys()
    for n, grad in grads.items():
        torch.testing.assert_close(regrads[n], grad, rtol=1e-4, atol=1e-6, msg=n)


def test_the_resident_mode_runs_a_fresh_one_thread_process_per_run_and_reports_their_largest(monkeypatch):
    """`bench.py memory --resident true`: each cell is the largest growth of `RESIDENT_RUNS` fresh processes, each
    running one training step of the row's model with one thread (a real child once, then three stand-ins)."""
    from posgpt.benchmarks import memory

    tiny = dataclasses.replace(BASE, n_layer=1, n_embd=32, n_head=2, vocab_size=16)
    monkeypatch.setattr(memory, "RESIDENT_RUNS", 1)
    assert memory.resident_bytes(tiny, 1, 16) >= 0  # the child's code runs and prints a number
    seen, growths = [], iter([3 << 20, 5 << 20, 4 << 20])
    monkeypatch.setattr(memory, "RESIDENT_RUNS", 3)
    monkeypatch.setattr(memory.subprocess, "run", lambda argv, env, **kw: seen.append(env["OMP_NUM_THREADS"]) or
                        types.SimpleNamespace(stdout=f"{next(growths)}\n"))  # fmt: skip
    assert memory.resident_bytes(tiny, 1, 16) == 5 << 20 and seen == ["1", "1", "1"]


def test_a_recomputed_part_keeps_one_node_and_gives_every_reads_gradient():
    """`model.recompute.recomputed`: the part's output and the gradients of what it reads (an input, a parameter
    read through a closure and also outside it, a non-leaf tensor a closure holds) equal one pass's, in float64; the
    graph holds one node for the part; dropout draws the same mask when formed again."""
    from posgpt.model.recompute import recomputed

    def run(once: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
        x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
        held = (x * 2).tanh()  # non-leaf, read by the part through its closure

        def part(y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout((y @ w).sigmoid() * held, 0.5) @ w.T

        out = part(x) if once else recomputed(part, x, random=True)
        assert once or type(out.grad_fn).__name__ == "_RecomputedBackward"
        (out.sin().sum() + (w * w).sum()).backward()  # w also read outside the part
        return out.detach(), [x.grad, w.grad]

    (out, grads), (again, regrads) = run(True), run(False)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    for grad, regrad in zip(grads, regrads, strict=True):
        torch.testing.assert_close(regrad, grad, rtol=1e-12, atol=1e-12)


def test_a_recomputed_part_compiles_as_a_checkpoint():
    """Inside a compiled graph the compiler plans the memory: the part is a `checkpoint` there, traced whole."""
    from posgpt.model.recompute import recomputed

    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    compiled = torch.compile(lambda x: recomputed(lambda y: (y @ w).sigmoid() @ w.T, x), backend="aot_eager",
                             fullgraph=True)  # fmt: skip
    compiled(x).sum().backward()
    expected = torch.autograd.grad(((x @ w).sigmoid() @ w.T).sum(), [x, w])
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(w.grad, expected[1])


def test_recomputed_eager_blocks_with_dropout_draw_their_mask_again_and_a_hidden_read_is_refused(monkeypatch):
    """The eager kernel's blocks with dropout are formed again from the first pass's random state; a tensor needing
    gradients that a part hands a custom autograd Function directly (unseen by the mode) fails loudly in backward."""
    from posgpt.model import recompute

    seen = []
    monkeypatch.setattr(dense, "recomputed", lambda *a, random=False: seen.append(random) or recompute.recomputed(
        *a, random=random))  # fmt: skip
    monkeypatch.setattr(dense, "RECOMPUTE_ELEMENTS", 0)
    config = dataclasses.replace(variants(BASE)["stick_breaking"], dropout=0.1)
    idx = torch.randint(0, config.vocab_size, (2, T))
    GPT(config).train()(idx, idx)[1].backward()
    assert seen and all(seen)

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, grad * x

    w, x = torch.nn.Parameter(torch.randn(3)), torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="unseen"):
        recompute.recomputed(lambda y: Scale.apply(y, w), x).sum().backward()
