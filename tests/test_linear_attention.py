"""Linear attention (Katharopoulos et al. 2020): three forms of one function (the layer around them is
in test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from posgpt.model.attention.linear import feature_map, linear_attention_chunked, linear_attention_quadratic
from posgpt.model.positions.tables import rope_cos_sin

from helpers import fidelity


def _inputs(T: int, D: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = torch.randn(3, 2, 3, T, D, dtype=torch.float64).unbind(0)
    fq, fk = feature_map(q).double(), feature_map(k).double()
    # a rotated copy for the numerator, as RoPE gives: any fixed orthogonal map will do here
    cos, sin = (t.double() for t in rope_cos_sin(T, D, 10000.0))
    pairs = [f.chunk(2, -1) for f in (fq, fk)]
    rq, rk = (torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1) for x1, x2 in pairs)
    return torch.cat([rq, fq], -1), torch.cat([rk, fk], -1), v


@fidelity(
    "`attention: linear`",
    paper="Katharopoulos et al. 2020",
    code="idiap/fast-transformers `CausalLinearAttention`, `elu_feature_map`",
    default="φ = elu + 1, running sums in chunks of 64; RoPE in the numerator only (RoFormer §3.3)",
    deviations="no ε in the denominator (theirs adds 1e-6; φ > 0 keeps it positive; no option)",
)
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
