"""Attention kernels: the parity matrix (every kernel of every attention function against that
function's reference, for every scheme, mask, score and layer option it can run, read from the registries),
causality, the reference by hand, and how `auto` chooses."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig
from posgpt.model.kernels import KERNELS, Kernel, KernelError, Plan, causal_mask, eager_attention, sdpa_attention
from posgpt.model.masks import AttentionMask
from posgpt.model.scores import SCORES
from posgpt.model.terms import Term

from helpers import (
    build,
    eager_with_weights,
    fidelity,
    is_flex,
    layer_variants,
    lengths,
    run_pair,
    scheme_kinds,
    uncompiled_flex,
)

ODD_LEN = 13  # not a multiple of 16 (FlexAttention's and the flash kernels' tile sizes)
MASKS: dict[str, dict[str, int]] = {
    "window": {"attn_window": 5},
    "window+sinks": {"attn_window": 5, "attn_sinks": 2},
    "bigbird": {"attn_window": 5, "attn_sinks": 1, "attn_random_blocks": 2, "attn_sparse_block": 4},
    "chunk": {"attn_chunk": 5},
}
SCORE_SCHEMES = tuple(scheme_kinds().values())
"""Schemes the other scores are checked with: a rotation, a fixed bias, a learned bias."""


def reference_of(function: str) -> str:
    """The kernel of `function` that forms the weights: the reference its other kernels must match."""
    return next(name for name, kernel in ATTENTIONS[function].kernels.items() if kernel.weights)


def runs_on_cpu(kernel: Kernel) -> bool:
    """Whether it runs here: by itself, or a flex kernel through FlexAttention's exact uncompiled path
    (`uncompiled_flex`; compiled flex is refused on a CPU and checked on a GPU: test_gpu.py)."""
    return kernel.devices is None or "cpu" in kernel.devices or is_flex(kernel)


def runs_backward_on_cpu(kernel: Kernel) -> bool:
    return kernel.backward_devices is None or "cpu" in kernel.backward_devices


def runnable(config: GPTConfig, **fields: Any) -> GPTConfig | None:
    """`config` with `fields`, or None where that combination is refused."""
    try:
        return dataclasses.replace(config, **fields)
    except ConfigError:
        return None


def every_scheme_masked(function: str, kernel: Kernel) -> bool:
    """Whether the parity matrix runs every scheme with every mask (the first function's kernels, but flex,
    whose uncompiled path forms the scores through the score_mod element-wise: seconds for FIRE's MLP), or
    three schemes (`SCORE_SCHEMES`)."""
    return function == next(iter(ATTENTIONS)) and not is_flex(kernel)


def parity_cases(config: GPTConfig) -> Iterator[tuple[str, GPTConfig, str, Kernel]]:
    """(id, config, kernel name, kernel) of the parity matrix: every kernel of every attention function but its
    reference, with every scheme, the masks and the other scores (`every_scheme_masked`; flex uncompiled,
    forward only: compiled and with gradients on a GPU)."""
    for function, layer in ATTENTIONS.items():
        for name, kernel in layer.kernels.items():
            if name == reference_of(function) or not runs_on_cpu(kernel):
                continue
            variants: list[tuple[str, str, dict[str, Any]]] = [(s, "causal", {}) for s in SCHEMES]
            masked = SCHEMES if every_scheme_masked(function, kernel) else SCORE_SCHEMES
            variants += [(s, mask, fields) for s in masked for mask, fields in MASKS.items()]
            variants += [(s, score, {"attn_score": score}) for score in SCORES for s in SCORE_SCHEMES
                         if score != GPTConfig.attn_score]  # fmt: skip
            variants += [(SCORE_SCHEMES[0], label, fields) for label, fields in layer_variants(config).items()]
            for scheme, label, fields in variants:
                case = runnable(config, attention=function, attn_backend=name, pos_encoding=scheme, **fields)
                if case is not None:
                    yield f"{function}-{name}-{scheme}-{label}", case, name, kernel


def assert_matches_reference(config: GPTConfig, backend: str) -> None:
    """Same weights and input: `backend` gives the float32 reference's logits, and its gradients where
    it has a backward pass on the CPU, at an odd length and at 4 x block_size."""
    for T, (ref_logits, ref_grads), (logits, grads) in run_pair(
        config, config.pos_encoding, backend, torch.device("cpu"), torch.float32, ODD_LEN
    ):
        torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4, msg=f"logits, T={T}")
        assert (ref_grads is None) == (not runs_backward_on_cpu(ATTENTIONS[config.attention].kernels[backend]))
        for name, grad in (grads or {}).items():
            torch.testing.assert_close(grad, ref_grads[name], atol=2e-5, rtol=1e-4, msg=f"{name}, T={T}")


TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)  # conftest's tiny_config
PARITY = [pytest.param(case, name, id=label) for label, case, name, kernel in parity_cases(TINY)]


def test_the_matrix_covers_every_kernel_scheme_mask_and_score():
    cases = list(parity_cases(TINY))
    labels = [label for label, *_ in cases]
    assert len(labels) == len(set(labels))
    for function, layer in ATTENTIONS.items():
        for name, kernel in layer.kernels.items():
            if name == reference_of(function) or not runs_on_cpu(kernel):
                continue
            mine = [label for label in labels if label.startswith(f"{function}-{name}-")]
            assert mine, f"{function}-{name} is never checked"
            if Term.MASK in kernel.terms:
                schemes = SCHEMES if every_scheme_masked(function, kernel) else SCORE_SCHEMES
                fields = {"attention": function, "attn_backend": name, **MASKS["window+sinks"]}
                expected = sum(runnable(TINY, pos_encoding=s, **fields) is not None for s in schemes)
                assert sum(label.endswith("-window+sinks") for label in mine) == expected
    assert {"softmax-sdpa-alibi-dot", "softmax-sdpa-t5-window", "linear-chunked-rope-causal"} <= set(labels)


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """Flex kernels run uncompiled here (`uncompiled_flex`)."""
    uncompiled_flex(monkeypatch)


@pytest.mark.usefixtures("flex_on_cpu")
@pytest.mark.parametrize(("config", "backend"), PARITY)
def test_every_kernel_matches_its_reference(config, backend):
    assert_matches_reference(config, backend)


CAUSALITY = [
    pytest.param(function, name, scheme, {}, id=f"{function}-{name}-{scheme}")
    for function, layer in ATTENTIONS.items()
    for name, kernel in layer.kernels.items()
    for scheme in (SCORE_SCHEMES if is_flex(kernel) else SCHEMES)  # flex: its block mask, the same for every scheme
    if runs_on_cpu(kernel) and runnable(TINY, attention=function, attn_backend=name, pos_encoding=scheme)
] + [
    pytest.param(function, name, SCORE_SCHEMES[0], fields, id=f"{function}-{name}-{label}")
    for function, layer in ATTENTIONS.items()
    for name, kernel in layer.kernels.items()
    for label, fields in layer_variants(TINY).items()
    if runs_on_cpu(kernel) and runnable(TINY, attention=function, attn_backend=name, pos_encoding=SCORE_SCHEMES[0],
                                        **fields)
]  # fmt: skip


@pytest.mark.usefixtures("flex_on_cpu")
@pytest.mark.parametrize(("function", "backend", "scheme", "fields"), CAUSALITY)
def test_future_tokens_never_change_past_logits(tiny_config, function, backend, scheme, fields):
    config = dataclasses.replace(tiny_config, attention=function, pos_encoding=scheme, attn_backend=backend, **fields)
    model = GPT(config).eval()
    vocab = tiny_config.vocab_size
    # flex's uncompiled path forms the scores through its score_mod element-wise (seconds for FIRE's MLP at
    # 4 x block_size): one length here, both in the parity test
    for T in [ODD_LEN] if is_flex(ATTENTIONS[function].kernels[backend]) else lengths(model.config, ODD_LEN):
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


@fidelity(
    "`attn_score: scaled_dot`", paper="Vaswani et al. 2017, §3.2.1", code="none", default="q·k/√d", deviations="none"
)
@fidelity(
    "`attention: softmax`",
    paper="Vaswani et al. 2017",
    code="none",
    default="softmax(score + bias, masked)·v",
    deviations="none",
)
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
    ("scheme", "device", "dropout_active", "decoding", "expected"),
    [
        ("alibi", "cpu", False, False, "sdpa"),
        ("alibi", "cuda", False, False, "flex"),
        ("alibi", "cuda", True, False, "sdpa"),
        ("alibi", "cuda", False, True, "sdpa"),
        ("rope", "cuda", False, False, "sdpa"),
        ("learned", "cpu", True, False, "sdpa"),
        ("none", "cpu", False, False, "sdpa"),
    ],
)
def test_auto_picks_the_fused_kernel_and_never_flex_on_cpu(tiny_config, scheme, device, dropout_active, decoding,
                                                           expected):  # fmt: skip
    layer, pe = ATTENTIONS["softmax"], SCHEMES[scheme]
    for needs_grad in (True, False):
        needs = layer.needs(pe, AttentionMask(), SCORES["scaled_dot"], torch.device(device), dropout_active,
                            needs_grad, decoding)  # fmt: skip
        assert layer.choose_kernel("auto", needs, torch.device(device)) is KERNELS[expected]


def test_auto_picks_eager_for_the_additive_score_and_chunked_for_linear_attention():
    softmax, linear = ATTENTIONS["softmax"], ATTENTIONS["linear"]
    cuda = torch.device("cuda")
    needs = softmax.needs(SCHEMES["rope"], AttentionMask(), SCORES["additive"], cuda, needs_grad=True)
    assert softmax.choose_kernel("auto", needs, cuda) is KERNELS["eager"]
    needs = linear.needs(SCHEMES["rope"], AttentionMask(), SCORES["scaled_dot"], cuda, needs_grad=True)
    assert linear.choose_kernel("auto", needs, cuda) is linear.kernels["chunked"]
    assert linear.weights_kernel(needs) is linear.kernels["eager"]


@pytest.mark.parametrize("function", ["softmax", "differential"])
def test_flex_needs_a_head_size_of_16_on_cuda(function):
    """Compiled FlexAttention on CUDA refuses heads under 16 (torch 2.11, seen on an H200): `auto` takes
    SDPA there, and flex by name names the head size. Differential attention's kernels see half-heads."""
    layer, cuda = ATTENTIONS[function], torch.device("cuda")
    for head_dim, expected in ((64, "flex"), (16, "flex" if function == "softmax" else "sdpa"), (8, "sdpa")):
        size = layer.kernel_head_size(head_dim)
        needs = layer.needs(SCHEMES["alibi"], AttentionMask(), SCORES["scaled_dot"], cuda, head_size=size)
        assert layer.choose_kernel("auto", needs, cuda) is KERNELS[expected]
        if expected == "sdpa":
            with pytest.raises(KernelError, match=rf"lacks heads under 16 wide on cuda \(here {size}, from n_embd"):
                layer.choose_kernel("flex", needs, cuda)


def test_flex_has_no_float64_on_cuda_so_auto_takes_sdpa_there(tiny_config, monkeypatch):
    """Triton's flex template fails to compile in float64 (an H200, torch 2.11: compiled decoding's prefill of
    every bias scheme in float64): `auto` takes SDPA for a float64 pass on CUDA, flex by name says why, and
    a forward pass tells the kernel choice whether it computes in float64."""
    layer, cuda, alibi = ATTENTIONS["softmax"], torch.device("cuda"), SCHEMES["alibi"]
    for float64, expected in ((False, "flex"), (True, "sdpa")):
        needs = layer.needs(alibi, AttentionMask(), SCORES["scaled_dot"], cuda, head_size=64, float64=float64)
        assert layer.choose_kernel("auto", needs, cuda) is KERNELS[expected]
    with pytest.raises(KernelError, match="lacks float64 on cuda"):
        layer.choose_kernel("flex", needs, cuda)
    seen = []
    real = GPT.kernel
    monkeypatch.setattr(GPT, "kernel", lambda self, *a, **kw: seen.append(kw["float64"]) or real(self, *a, **kw))
    model = GPT(tiny_config)
    idx = torch.zeros(1, 4, dtype=torch.long)
    model(idx)
    model.double()(idx)
    assert seen == [False, True]


WITH_FLEX = [function for function, layer in ATTENTIONS.items() if any(map(is_flex, layer.kernels.values()))]


@pytest.mark.parametrize("function", WITH_FLEX)
def test_flex_on_a_cpu_is_refused_in_one_line_naming_what_runs(tiny_config, function):
    """Compiled FlexAttention returns wrong numbers on a CPU in torch 2.13 (at 24, 40, 56 tokens: issue 33,
    model/kernels/flex.py): asked for by name there, flex is refused at the forward pass, with gradients
    or without, and the message names the kernels that run instead."""
    config = dataclasses.replace(tiny_config, attention=function, block_size=64)
    for train in (False, True):
        model = build(config, "alibi", "flex").train(train)
        for T in (24, 40, 56):
            idx = torch.randint(0, 64, (1, T))
            with pytest.raises(KernelError) as info, torch.set_grad_enabled(train):
                model(idx, idx)
            line = str(info.value)
            assert "\n" not in line and "flex" in line and "forward pass on cpu" in line and "wrong numbers" in line
            kernels = ATTENTIONS[function].kernels.items()  # those that run on a CPU: not fla's without Triton's
            others = ", ".join(n for n, k in kernels if not is_flex(k) and (k.devices is None or "cpu" in k.devices))
            assert line.endswith(f"Kernels that can: {others} (or attn_backend='auto').")


def test_auto_trains_alibi_on_cpu(tiny_config):
    model = build(tiny_config, "alibi", "auto").train()
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("scheme", SCORE_SCHEMES[:2])
def test_sdpa_under_cpu_bf16_autocast_attends_in_float32_and_matches_the_reference(tiny_config, scheme, monkeypatch):
    """bf16 training on a CPU: the projections run in bf16, the fused attention in float32 (its bf16
    kernel is the slower one there); logits and gradients stay close to the float32 reference."""
    import posgpt.model.kernels.sdpa as sdpa

    seen: list[torch.dtype] = []
    real = sdpa.F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", recording)
    for T, (ref_logits, ref_grads), (logits, grads) in run_pair(
        tiny_config, scheme, "sdpa", torch.device("cpu"), torch.bfloat16, ODD_LEN
    ):
        assert seen and set(seen) == {torch.float32}, f"T={T}"
        seen.clear()
        assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < 2e-2, f"logits, T={T}"
        for name, grad in grads.items():
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0)
            assert cosine > 0.98, f"gradient of {name}, T={T}: cosine {cosine:.4f}"


def _checked_backward(gm: torch.fx.GraphModule, inputs: list) -> Any:
    """aot_autograd's backward compiler: the check a GPU's compiled flex makes of its score_mod's joint graph."""
    from functorch.compile import make_boxed_func
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.flex_attention_backward:
            validate_joint_graph(getattr(gm, node.args[8].target).graph)
    return make_boxed_func(gm)


LEARNED_BIASES = [
    {"pos_encoding": name}
    for name, scheme in SCHEMES.items()
    if scheme.learned_bias and Term.FROM_SCORES not in scheme.terms
] + [{"pos_encoding": "fire", "fire_per_layer": True, "n_layer": 2}]


@pytest.mark.parametrize("fields", LEARNED_BIASES, ids=lambda f: "-".join(map(str, f.values())))
def test_flex_carries_the_gradient_of_every_learned_bias(tiny_config, fields):
    """Compiled FlexAttention's backward (CUDA only) refuses a score_mod that reads a tensor with a gradient
    twice or transforms it, and gives a view of a parameter no gradient (`ScoreBias`; Kerple and FIRE
    failed so on an H200). aot_eager runs the same joint graph on a CPU: torch's own check passes, and every
    parameter of the scheme gets the eager kernel's gradient (the last layer's bias where each has one)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.nn.attention.flex_attention import flex_attention

    from posgpt.model.kernels import Placement
    from posgpt.model.kernels.block_mask import eager_block_mask
    from posgpt.model.kernels.flex import score_mod_of

    config = dataclasses.replace(tiny_config, **fields, fire_width=4)  # FIRE: 16 tensors read once, not 100
    pe, layer = GPT(config).pe, config.n_layer - 1
    torch.manual_seed(0)
    T, H = 40, config.n_head
    q, k, v = (torch.randn(2, H, T, config.head_dim) for _ in range(3))  # no gradient: flex on a CPU has none
    step, weights = Placement(T, H, torch.device("cpu")), torch.randn(2, H, T, config.head_dim)
    checked = aot_autograd(fw_compiler=lambda gm, inputs: make_boxed_func(gm), bw_compiler=_checked_backward)
    flex = torch.compile(flex_attention, backend=checked, fullgraph=True)
    score_mod, block_mask = score_mod_of(pe.bias(layer), step), eager_block_mask(AttentionMask(), step, {})
    (flex(q, k, v, score_mod=score_mod, block_mask=block_mask) * weights).sum().backward()
    got = {name: p.grad.clone() for name, p in pe.named_parameters() if p.grad is not None}
    pe.zero_grad(set_to_none=True)
    context = KERNELS["eager"].context(pe.bias(layer), AttentionMask(), step, {})
    score = SCORES[config.attn_score].build(config)
    (Plan(KERNELS["eager"], context, step).attend(q, k, v, score, 0.0) * weights).sum().backward()
    assert got.keys() == {name for name, _ in pe.named_parameters()}  # a view would have none
    for name, p in pe.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)  # b2: 0 (softmax shift)


def test_flex_runs_t5_with_the_tiles_its_bias_declares(tiny_config, monkeypatch):
    """T5's score_mod did not fit FlexAttention's default tiles on an H200 (model/positions/biases.py,
    T5_TILES): its bias declares smaller ones, and the flex kernel passes them to the compiled call;
    a bias that declares none passes none."""
    import posgpt.model.kernels.flex as flex
    from posgpt.model.kernels import Placement
    from posgpt.model.positions.biases import T5_TILES

    seen = []
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: lambda q, k, v, **kw: seen.append(kw) or q)
    step, q = Placement(8, tiny_config.n_head, torch.device("cpu")), torch.zeros(1, tiny_config.n_head, 8, 16)
    for scheme in ("t5", "alibi"):
        pe = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)).pe
        context = KERNELS["flex"].context(pe.bias(0), AttentionMask(), step, {})
        Plan(KERNELS["flex"], context, step).attend(q, q, q, SCORES[tiny_config.attn_score].build(tiny_config), 0.0)
    assert [kw["kernel_options"] for kw in seen] == [T5_TILES, None]
