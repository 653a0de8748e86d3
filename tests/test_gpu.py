"""CUDA checks of the kernels: bf16 agreement with the float32 reference, the FlashAttention kernel really runs for
bias-free SDPA, compiled FlexAttention runs the biases and masks (forward and backward). Skipped without CUDA;
test_gpu_runs.py trains, evaluates and decodes on CUDA, test_gpu_paths.py runs what of this a CPU can."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, POS_ENCODINGS, SCHEMES, GPTConfig
from posgpt.model.kernels import compiled_flex_attention
from posgpt.model.positions import random_positions
from posgpt.model.terms import Term

from helpers import build, relative_error, run_pair, scheme_kinds

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
ODD_LEN = 200  # not a multiple of 16 or of FlexAttention's 128-token blocks
KINDS = scheme_kinds()
NOTHING = next(name for name, s in SCHEMES.items() if not (s.embeds or s.rotates or s.terms or s.uses_positions))
"""The scheme with no position signal at all (NoPE)."""
OTHER_FUNCTIONS = [name for name in ATTENTIONS if name != GPTConfig.attention]


@pytest.fixture
def gpu_config() -> GPTConfig:
    """Head size 64, as in GPT-2, so every fused kernel applies; block 128, so 4x is 512."""
    return GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=256, bias=False)


def fused_kernels(scheme: str, attention: str = GPTConfig.attention) -> list[str]:
    """The fused kernels (those that form no weights: sdpa, flex, chunked) that run `scheme` with `attention`; the
    reference alone (in bf16) where none does (CoPE needs the scores, stick-breaking has only its eager kernel)."""
    kernels = ATTENTIONS[attention].kernels
    runs = []
    for backend, kernel in kernels.items():
        try:
            if not kernel.weights:
                GPTConfig(pos_encoding=scheme, attention=attention, attn_backend=backend)
                runs.append(backend)
        except ConfigError:
            continue
    return runs or [next(name for name, kernel in kernels.items() if kernel.weights)]


@pytest.mark.parametrize(("scheme", "backend"), [(s, b) for s in POS_ENCODINGS for b in fused_kernels(s)])
def test_backend_in_bf16_matches_float32_eager(gpu_config, scheme, backend):
    assert_bf16_matches_eager(gpu_config, scheme, backend)


QUERY_BIAS = next(
    name for name, s in SCHEMES.items() if Term.POSITIONS in s.terms and s.learned_bias and not s.relative
)
"""A learned bias that reads the query's position, not the distance alone (FIRE)."""
SAMPLE = (KINDS["rotation"], KINDS["fixed bias"], QUERY_BIAS)
SAMPLED_FUNCTIONS = [("sigmoid", s, "flex") for s in SAMPLE] + [("differential", s, "flex") for s in SAMPLE] + [
    ("forgetting", s, b) for s in (NOTHING, KINDS["fixed bias"]) for b in fused_kernels(s, "forgetting")] + [
    ("stick_breaking", NOTHING, "eager")]  # fmt: skip
"""A sample chosen by hand (each case a few compiles): a rotation, a fixed bias and a query-dependent learned one on
the flex kernels; FoX and stick-breaking without positions (their papers' setting). A function it lacks runs below
with no positions and with a rotation, on each of its fused kernels."""
SAMPLED_FUNCTIONS += [(f, s, b) for f in OTHER_FUNCTIONS if f not in {a for a, _, _ in SAMPLED_FUNCTIONS}
                      for s in (NOTHING, KINDS["rotation"]) for b in fused_kernels(s, f)]  # fmt: skip


@pytest.mark.parametrize(("attention", "scheme", "backend"), SAMPLED_FUNCTIONS)
def test_the_other_functions_kernels_match_their_eager_reference_in_bf16(gpu_config, attention, scheme, backend):
    assert_bf16_matches_eager(dataclasses.replace(gpu_config, attention=attention), scheme, backend)


def assert_bf16_matches_eager(gpu_config: GPTConfig, scheme: str, backend: str) -> None:
    """`backend` under bf16 autocast against the float32 reference: logits and every gradient."""
    longest = SCHEMES[scheme].longest(dataclasses.replace(gpu_config, pos_encoding=scheme))
    if longest is not None and longest < ODD_LEN:
        gpu_config = dataclasses.replace(gpu_config, block_size=256)  # room for ODD_LEN
    for T, (ref_logits, ref_grads), (logits, grads) in run_pair(
        gpu_config, scheme, backend, CUDA, torch.bfloat16, ODD_LEN
    ):
        assert torch.isfinite(logits).all()
        assert relative_error(logits, ref_logits) < 2e-2, f"logits, T={T}"
        flat = torch.cat([g.flatten() for g in grads.values()])
        ref_flat = torch.cat([ref_grads[name].flatten() for name in grads])
        assert relative_error(flat, ref_flat) < 5e-2, f"all gradients, T={T}"
        for name, grad in grads.items():
            if ref_grads[name].norm() <= 1e-4 * ref_flat.norm():  # 0 but for rounding: FIRE's b2, a per-head
                continue  # constant that softmax cancels (a cosine of rounding noise failed on an H200)
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0)
            assert cosine > 0.99, f"gradient of {name}, T={T}: cosine {cosine:.4f}"


def _forward_backward(model, idx):
    with torch.autocast("cuda", torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    torch.cuda.synchronize()
    return loss


def test_bias_free_sdpa_runs_the_flash_kernel(gpu_config):
    model = build(gpu_config, KINDS["rotation"], "sdpa").to(CUDA)
    idx = torch.randint(0, gpu_config.vocab_size, (4, 512), device=CUDA)
    # with every other SDPA kernel disabled, a call that cannot use FlashAttention raises
    with (
        sdpa_kernel(SDPBackend.FLASH_ATTENTION),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        loss = _forward_backward(model, idx)
    assert torch.isfinite(loss)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention" in ops, sorted(ops)
    # control: a bias's float mask (ALiBi's) is not something the flash kernel accepts, so the same
    # restriction makes it fail; the restriction is real
    biased = build(gpu_config, KINDS["fixed bias"], "sdpa").to(CUDA)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError):
        _forward_backward(biased, idx)


def test_auto_alibi_trains_through_compiled_flex_on_cuda(gpu_config):
    from posgpt.model.kernels import KERNELS
    from posgpt.model.scores import SCORES

    model = GPT(dataclasses.replace(gpu_config, pos_encoding="alibi"))
    needs = model.kinds[0].attention.needs(model.pe, model.kinds[0].mask, SCORES["scaled_dot"], CUDA, needs_grad=True)
    assert model.kinds[0].attention.choose_kernel("auto", needs, CUDA) is KERNELS["flex"]
    model = build(gpu_config, "alibi", "auto").to(CUDA)
    reference = build(gpu_config, "alibi", "eager").to(CUDA)
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, gpu_config.vocab_size, (2, 4 * gpu_config.block_size), device=CUDA)
    loss = _forward_backward(model, idx)
    assert compiled_flex_attention.cache_info().currsize == 1  # the shared compiled kernel ran
    ref_loss = _forward_backward(reference, idx)
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    assert model.wte.weight.grad is not None and torch.isfinite(model.wte.weight.grad).all()


LEARNED_TERMS = [{"pos_encoding": name} for name, scheme in SCHEMES.items()  # every learned bias flex runs
                 if scheme.learned_bias and Term.FROM_SCORES not in scheme.terms] + [
    {"pos_encoding": "fire", "fire_per_layer": True},  # FIRE's option: a bias per layer
    {"pos_encoding": KINDS["rotation"], "attn_window": 64, "attn_sinks": 4},  # a window on a rotation and a bias
    {"pos_encoding": KINDS["fixed bias"], "attn_window": 64},
    {"pos_encoding": KINDS["rotation"], "attn_window": 32, "attn_sinks": 4, "attn_random_blocks": 2,
     "attn_sparse_block": 16}] + [  # each function with learned terms of its own (FoX's gates), alone and with a bias
    extra for f, layer in ATTENTIONS.items() if layer.terms for extra in (
        {"pos_encoding": NOTHING, "attention": f},
        {"pos_encoding": KINDS["fixed bias"], "attention": f, "attn_window": 64, "attn_sinks": 4})]  # fmt: skip


@pytest.mark.parametrize("extra", LEARNED_TERMS)
def test_flex_learned_bias_and_window_masks_match_eager_with_gradients_on_cuda(gpu_config, extra):
    """Only a GPU runs FlexAttention's backward: the gradients of learned biases (T5's table, a captured tensor
    read by the score_mod) and of a function's own terms, and the block masks of windows, against the eager
    reference, in float32."""
    config = dataclasses.replace(gpu_config, **extra)
    model = GPT(dataclasses.replace(config, attn_backend="flex")).to(CUDA)
    reference = GPT(dataclasses.replace(config, attn_backend="eager")).to(CUDA)
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 2 * config.block_size + 13), device=CUDA)
    for m in (model, reference):
        _, loss = m(idx, idx)
        loss.backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-4, rtol=1e-3, msg=name)
    if model.pe.learned_bias:  # every parameter of the scheme gets a gradient through flex (T5's table, Kerple's
        whole = torch.cat([r.grad.flatten() for r in reference.pe.parameters()]).norm()  # r1 and r2, ...)
        assert whole > 0
        for (name, p), r in zip(model.pe.named_parameters(), reference.pe.parameters(), strict=True):
            cancelled = r.grad.norm() <= 1e-4 * whole  # 0 but for rounding: FIRE's b2, which softmax cancels
            assert cancelled or p.grad.abs().sum() > 0, name
    if ATTENTIONS[config.attention].terms:  # the layer's own terms (FoX's gate sums, captured by the score_mod)
        assert all(p.grad.abs().sum() > 0 for p in model.blocks[0].attn.parameters())  # carry gradients


@pytest.mark.parametrize("scheme", KINDS.values())
def test_randomized_positions_through_flex_match_eager_with_gradients_on_cuda(gpu_config, scheme):
    """Each row's own positions (B, T) reach FlexAttention's score_mod (ids[b, q] - ids[b, kv]) and
    RoPE's tables as they reach the eager reference, gradients included."""
    config = dataclasses.replace(gpu_config, pos_encoding=scheme)
    model = GPT(dataclasses.replace(config, attn_backend="flex")).to(CUDA)
    reference = GPT(dataclasses.replace(config, attn_backend="eager")).to(CUDA)
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, ODD_LEN), device=CUDA)
    positions = random_positions(2, ODD_LEN, 4 * config.block_size, torch.Generator().manual_seed(0), CUDA)
    for m in (model, reference):
        m.pe.reserve(4 * config.block_size)
        _, loss = m(idx, idx, positions=positions)
        loss.backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_masked_sdpa_gradients_stay_finite_on_the_cudnn_fault_shape():
    """pytorch#196678: cuDNN's backward gave NaN grad_q with a bias at a length 64 past a multiple of 128 when a row's
    log-sum-exp is very negative. posgpt's masked SDPA call with a gradient stays off cuDNN (`off_cudnn`)."""
    from posgpt.model.kernels.sdpa import sdpa_attention

    torch.manual_seed(0)
    T = 192
    q, k, v = (torch.randn(2, 4, T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    visible = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    bias = torch.zeros(T, T, device="cuda").masked_fill(~visible, float("-inf"))
    bias[:8] = bias[:8] - 1e4  # the first rows' every visible score very negative: their log-sum-exp too
    sdpa_attention(q, k, v, bias=bias).float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
