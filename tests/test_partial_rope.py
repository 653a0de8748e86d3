"""Partial rotation (`rope_fraction`, `rope_partial`): p-RoPE (Barbero et al. 2025) turns only the
fastest frequency pairs, GPT-NeoX's rotary_pct rotates the first dimensions; each against its
formula written here, relative positions only, fraction 1 is today's RoPE, decoding with a cache
equals a full forward, and one message for each fraction that cannot be built."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import GPT, GPTConfig

from helpers import fidelity

BASE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False, pos_encoding="rope")
D = BASE.head_dim  # 16: 8 frequency pairs (i, i + 8)


def _rotate(config: GPTConfig, x: torch.Tensor, start: int = 0) -> torch.Tensor:
    return GPT(config).pe.rotate(x, x, torch.arange(start, start + x.size(-2))[None])[0]


def _by_hand(x: torch.Tensor, dims: list[int], freqs: list[float], positions: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (dims[i], dims[i + len(freqs)]) by position x freqs[i], one pair at a time."""
    out = x.clone()
    half = len(freqs)
    for i, theta in enumerate(freqs):
        a, b = dims[i], dims[i + half]
        angle = positions * theta
        out[..., a] = x[..., a] * torch.cos(angle) - x[..., b] * torch.sin(angle)
        out[..., b] = x[..., b] * torch.cos(angle) + x[..., a] * torch.sin(angle)
    return out


@fidelity(
    "`rope_partial: p_rope`",
    paper="Barbero et al. 2025",
    code="none cited: the paper's definition",
    default="with `rope_fraction` < 1 (default 1), the fastest pairs turn, the slowest stay unrotated",
    deviations="`rope_partial neox`",
)
def test_p_rope_turns_the_fastest_pairs_and_leaves_the_slowest_as_they_are():
    config = dataclasses.replace(BASE, rope_fraction=0.25)  # 2 of 8 pairs
    x = torch.randn(1, 2, 5, D)
    got = _rotate(config, x, start=3)
    full_freqs = [10000.0 ** (-2 * i / D) for i in range(D // 2)]
    expected = _by_hand(x, list(range(D)), [*full_freqs[:2], *[0.0] * 6], torch.arange(3, 8.0))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    slow = [i for p in range(2, 8) for i in (p, p + 8)]
    assert torch.equal(got[..., slow], x[..., slow])


@fidelity(
    "`rope_partial: neox`",
    paper="GPT-NeoX (Black et al. 2022)",
    code="EleutherAI/gpt-neox `rotary_pct` (`rotary_ndims`)",
    default="first fraction × D dimensions rotated, frequencies spread over them",
    deviations="a fraction that is no whole number of pairs is refused; NeoX truncates it with `int()` (no option)",
)
def test_neox_rotates_the_first_dimensions_with_frequencies_over_them():
    config = dataclasses.replace(BASE, rope_fraction=0.5, rope_partial="neox")  # 8 of 16 dimensions
    x = torch.randn(1, 2, 5, D)
    got = _rotate(config, x)
    r = 8
    freqs = [10000.0 ** (-2 * i / r) for i in range(r // 2)]  # spread over the rotated dimensions
    expected = _by_hand(x[..., :r], list(range(r)), freqs, torch.arange(5.0))
    torch.testing.assert_close(got[..., :r], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., r:], x[..., r:])


@pytest.mark.parametrize("partial", ["p_rope", "neox"])
def test_a_fraction_of_one_is_todays_rope(partial):
    x = torch.randn(2, 2, 7, D)
    torch.testing.assert_close(_rotate(dataclasses.replace(BASE, rope_partial=partial), x, 4), _rotate(BASE, x, 4))


@pytest.mark.parametrize("partial", ["p_rope", "neox"])
def test_scores_depend_on_the_distance_only(partial):
    pe = GPT(dataclasses.replace(BASE, rope_fraction=0.5, rope_partial=partial)).pe
    q, k = torch.randn(2, 1, 1, 1, D).unbind(0)
    scores = []
    for shift in (0, 9):
        rq, _ = pe.rotate(q, q, torch.tensor([[5 + shift]]))
        _, rk = pe.rotate(k, k, torch.tensor([[2 + shift]]))
        scores.append((rq * rk).sum())
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("partial", ["p_rope", "neox"])
def test_decoding_with_a_cache_equals_the_full_forward(partial):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, rope_fraction=0.5, rope_partial=partial)).eval()
    idx = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache(16, batch=2)
        first = model(idx[:, :6], cache=cache)[0]
        steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(6, 11)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"rope_fraction": -0.5}, "rope_fraction must be in (0, 1]"),
        ({"rope_fraction": 0.3}, "is 2.4 pairs: pick k / 8"),
        (
            {"rope_fraction": 0.1875, "rope_partial": "neox"},
            "rotates 3 of the head's 16 dimensions; it must be an even",
        ),
        ({"rope_fraction": 0.5, "pos_encoding": "alibi"}, "which pos_encoding='alibi' does not do"),
        ({"rope_partial": "first"}, "rope_partial must be one of"),
    ],
)
def test_a_fraction_that_cannot_be_built_is_one_clear_message(fields, needle):
    with pytest.raises(ConfigError) as error:
        dataclasses.replace(BASE, **fields)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_the_learned_model_trains_through_every_kernel_with_partial_rope():
    torch.manual_seed(0)
    losses = []
    for backend in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(BASE, rope_fraction=0.5, attn_backend=backend))
        idx = torch.randint(0, 64, (2, 17))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and math.isfinite(losses[0])


def test_ntk_over_two_rotated_dimensions_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="rope_scaling='ntk' scales the base by D / \\(D - 2\\) of the 2 rotated"):
        dataclasses.replace(BASE, rope_fraction=0.125, rope_partial="neox", rope_scaling="ntk")
