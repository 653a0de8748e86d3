"""Linear attention (Katharopoulos et al. 2020): three forms of one function, and the model around it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import GPT, GPTConfig
from model.kernels import KERNELS, AttentionContext
from model.linear_attention import feature_map, linear_attention_chunked, linear_attention_quadratic
from model.positions import apply_rope, rope_cos_sin

from helpers import overfit

SCHEMES = ["learned", "sinusoidal", "rope", "none"]


def _inputs(T: int, D: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = torch.randn(3, 2, 3, T, D, dtype=torch.float64).unbind(0)
    fq, fk = feature_map(q).double(), feature_map(k).double()
    # a rotated copy for the numerator, as RoPE gives: any fixed orthogonal map will do here
    cos, sin = rope_cos_sin(T, D, 10000.0)
    rq, rk = apply_rope(fq, cos.double(), sin.double()), apply_rope(fk, cos.double(), sin.double())
    return torch.cat([rq, fq], -1), torch.cat([rk, fk], -1), v


def test_the_quadratic_form_by_hand():
    q2, k2, v = _inputs(4)
    out = linear_attention_quadratic(q2, k2, v)
    rq, fq = q2.chunk(2, -1)
    rk, fk = k2.chunk(2, -1)
    b, h, i = 1, 2, 3  # query 3 sees keys 0..3
    numerator = sum((rq[b, h, i] @ rk[b, h, j]) * v[b, h, j] for j in range(4))
    denominator = sum(fq[b, h, i] @ fk[b, h, j] for j in range(4))
    torch.testing.assert_close(out[b, h, i], (numerator / denominator).to(out.dtype))


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("T", [13, 70])
def test_the_chunked_form_equals_the_quadratic_one(T, chunk):
    q2, k2, v = _inputs(T)
    chunked, state = linear_attention_chunked(q2, k2, v, chunk=chunk)
    torch.testing.assert_close(chunked, linear_attention_quadratic(q2, k2, v), rtol=1e-9, atol=1e-9)
    # the state is the running sums over every token
    rk, fk = k2.chunk(2, -1)
    torch.testing.assert_close(state.z, fk.sum(-2))
    torch.testing.assert_close(state.S, rk.transpose(-2, -1) @ v)


def test_continuing_from_a_state_equals_one_pass():
    q2, k2, v = _inputs(20)
    whole, _ = linear_attention_chunked(q2, k2, v, chunk=4)
    first, state = linear_attention_chunked(q2[:, :, :7], k2[:, :, :7], v[:, :, :7], chunk=4)
    pieces = [first]
    for t in range(7, 20):  # then token by token, as decoding does
        out, state = linear_attention_chunked(q2[:, :, t : t + 1], k2[:, :, t : t + 1], v[:, :, t : t + 1], state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 2), whole, rtol=1e-9, atol=1e-9)


def _linear(tiny_config: GPTConfig, scheme: str, **extra) -> GPTConfig:
    return dataclasses.replace(tiny_config, pos_encoding=scheme, attention="linear", **extra)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_chunked_kernel_matches_the_quadratic_reference_in_the_model(tiny_config, scheme):
    reference = GPT(_linear(tiny_config, scheme, attn_backend="eager"))
    chunked = GPT(_linear(tiny_config, scheme, attn_backend="chunked"))
    chunked.load_state_dict(reference.state_dict())
    T = 13 if scheme == "learned" else 4 * tiny_config.block_size
    idx = torch.randint(0, tiny_config.vocab_size, (2, T))
    logits = []
    for model in (reference, chunked):
        out, loss = model(idx, idx)
        loss.backward()
        logits.append(out)
    torch.testing.assert_close(logits[1], logits[0], atol=2e-5, rtol=1e-4)
    for (name, p), q in zip(chunked.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_recurrent_decoding_equals_the_parallel_forward(tiny_config, scheme):
    model = GPT(_linear(tiny_config, scheme)).eval()
    idx = torch.randint(0, tiny_config.vocab_size, (2, 14))
    cache = model.new_cache(0)
    with torch.no_grad():
        full, _ = model(idx)
        steps = [model(idx[:, :5], cache=cache)[0]] + [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].state.S.shape == (2, tiny_config.n_head, tiny_config.head_dim, tiny_config.head_dim)
    prompt = idx[:, :3]
    assert torch.equal(
        model.generate(prompt, 30, temperature=0), model.generate(prompt, 30, temperature=0, use_cache=False)
    )


def test_rope_in_the_numerator_depends_on_relative_positions_only(tiny_config):
    """RoFormer's linear attention: R_i phi(q) . R_j phi(k) depends on j - i, the denominator on no
    position, so shifting every position leaves the layer's output unchanged."""
    model = GPT(_linear(tiny_config, "rope", n_layer=1)).eval()
    attention = model.blocks[0].attn
    x = torch.randn(1, 9, tiny_config.n_embd)
    outs = []
    for start in (0, 7):  # the 9 tokens at positions 0..8, then at 7..15 (no earlier tokens either time)
        ctx = AttentionContext(KERNELS[("linear", "eager")], start, 9, start + 9)
        with torch.no_grad():
            outs.append(attention(x, model.pe, ctx))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [({"pos_encoding": "alibi"}, "position score bias"), ({"pos_encoding": "t5"}, "position score bias"),
     ({"attn_window": 4}, "a mask beyond causal"), ({"attn_backend": "sdpa"}, "linear attention")],
)  # fmt: skip
def test_what_linear_attention_cannot_express_fails_at_construction(tiny_config, extra, needle):
    with pytest.raises(ValueError, match=needle):
        GPT(dataclasses.replace(tiny_config, attention="linear", **extra))


def test_a_linear_attention_model_overfits_a_batch(tiny_config):
    _, final = overfit(GPT(_linear(tiny_config, "rope")))
    assert final < 0.3
