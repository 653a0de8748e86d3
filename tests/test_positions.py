"""Each position scheme against its paper's definition."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.model import ATTENTIONS, GPT, POS_ENCODINGS, SCHEMES, GPTConfig
from posgpt.model.kernels import dense
from posgpt.model.masks import AttentionMask
from posgpt.model.positions import (
    ALiBi,
    RotaryPositions,
    SinusoidalPositions,
    T5Bias,
    alibi_slopes,
    random_positions,
    sinusoid_table,
    t5_bucket,
)
from posgpt.model.positions.tables import rope_cos_sin
from posgpt.model.scores import SCORES
from posgpt.model.terms import Term

from helpers import fidelity

KERNELS = ATTENTIONS[GPTConfig.attention].kernels
CPU_KERNELS = [name for name, kernel in KERNELS.items() if kernel.devices is None or "cpu" in kernel.devices]
"""The default attention function's kernels that run on a CPU by themselves (flex: uncompiled in test_kernels.py,
compiled on a GPU in test_gpu.py)."""
BIASES = [name for name, scheme in SCHEMES.items() if Term.POSITIONS in scheme.terms]
"""The schemes whose bias is a formula of positions (`ScoreBias`): a dense tensor and a flex score_mod."""


def test_alibi_slopes_for_8_heads_are_the_papers_geometric_sequence():
    assert alibi_slopes(8) == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]


@fidelity(
    "`pos_encoding: alibi`",
    paper="Press et al. 2022",
    code="ofirpress/attention_with_linear_biases `get_slopes`",
    default="−m_h·(i − j), geometric slopes 2^(−8/n), the paper's rule for other head counts",
    deviations="none",
)
def test_alibi_slopes_for_head_counts_that_are_not_powers_of_two():
    # The paper's rule: slopes of the closest power of two, then every other slope of twice that.
    assert alibi_slopes(6) == pytest.approx([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    expected_12 = [2.0**-i for i in range(1, 9)] + [
        0.7071067811865476,  # 2^-0.5
        0.3535533905932738,  # 2^-1.5
        0.17677669529663687,  # 2^-2.5
        0.08838834764831843,  # 2^-3.5
    ]
    assert alibi_slopes(12) == pytest.approx(expected_12, rel=1e-12)
    assert alibi_slopes(4) == [1 / 4, 1 / 16, 1 / 64, 1 / 256]


def _decoding_bias(pe, n_head: int, q_len: int, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense kernel's (H, Tq, Tk) bias and the flex score_mod's, for queries that are the last Tq of Tk
    positions (as decoding puts them)."""
    from posgpt.model.kernels import Placement
    from posgpt.model.kernels.flex import score_mod_of
    from posgpt.model.masks import AttentionMask

    start = k_len - q_len
    step = Placement(q_len, n_head, torch.device("cpu"), torch.arange(start, k_len)[None], torch.arange(k_len)[None])
    _, bias = KERNELS["eager"].context(pe.bias(), AttentionMask(), step, {}).block(slice(0, q_len))
    h = torch.arange(n_head)[:, None, None]
    q_idx = torch.arange(q_len)[None, :, None]
    kv_idx = torch.arange(k_len)[None, None, :]
    modded = score_mod_of(pe.bias(), step)(torch.zeros(n_head, q_len, k_len), torch.tensor(0), h, q_idx, kv_idx)
    return bias[0], modded  # the dense bias is the same for every batch row


@pytest.mark.parametrize(("q_len", "k_len"), [(7, 7), (3, 11), (1, 20)])
@pytest.mark.parametrize("scheme", BIASES)
def test_the_dense_bias_and_the_flex_score_mod_agree(tiny_config, scheme, q_len, k_len):
    """The two derivations of one formula (`ScoreBias`): eager/SDPA's dense (H, Tq, Tk) tensor
    and FlexAttention's score_mod, for queries that are the last Tq of Tk positions (as decoding puts them)."""
    pe = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)).pe
    n_head, start = tiny_config.n_head, k_len - q_len
    bias, modded = _decoding_bias(pe, n_head, q_len, k_len)
    visible = bias > float("-inf")
    assert visible.sum() == n_head * sum(start + i + 1 for i in range(q_len))  # the causal triangle
    torch.testing.assert_close(modded[visible], bias[visible])
    # and both are the formula at the distance i - j, i the query's absolute position (the last query's row)
    h, distance = torch.arange(n_head)[:, None], (k_len - 1 - torch.arange(k_len))[None]
    torch.testing.assert_close(bias[:, -1], pe.bias().formula(h, distance, torch.tensor(k_len - 1)))


@fidelity("`pos_encoding: alibi`")
def test_alibis_bias_is_minus_the_slope_times_the_distance(tiny_config):
    """ALiBi's formula on both derivations: -m_h * (i - j) with i the query's absolute position."""
    n_head, q_len, k_len = tiny_config.n_head, 3, 11
    bias, modded = _decoding_bias(ALiBi(dataclasses.replace(tiny_config, pos_encoding="alibi")), n_head, q_len, k_len)
    slopes = torch.tensor(alibi_slopes(n_head))
    torch.testing.assert_close(bias[:, -1, 0], -slopes * (k_len - 1))
    torch.testing.assert_close(modded[:, -1, 0], -slopes * (k_len - 1))


@pytest.mark.parametrize("scheme", BIASES)
def test_with_positions_per_row_the_dense_bias_and_the_score_mod_agree(tiny_config, scheme):
    """Randomized positions: both derivations read each row's own positions (B, H, T, T)."""
    from posgpt.model.kernels import Placement
    from posgpt.model.kernels.flex import score_mod_of
    from posgpt.model.masks import AttentionMask

    pe = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)).pe
    ids = random_positions(3, 9, 40, torch.Generator().manual_seed(0))
    n_head = tiny_config.n_head
    step = Placement(9, n_head, torch.device("cpu"), ids)
    _, bias = KERNELS["eager"].context(pe.bias(), AttentionMask(), step, {}).block(slice(0, 9))
    assert bias.shape == (3, n_head, 9, 9)
    score_mod = score_mod_of(pe.bias(), step)
    b, h = torch.arange(3)[:, None, None, None], torch.arange(n_head)[None, :, None, None]
    q_idx, kv_idx = torch.arange(9)[None, None, :, None], torch.arange(9)[None, None, None, :]
    modded = score_mod(torch.zeros(3, n_head, 9, 9), b, h, q_idx, kv_idx)
    visible = bias > float("-inf")
    torch.testing.assert_close(modded[visible], bias[visible])
    expected = pe.bias().formula(h[0], (ids[2, 8] - ids[2, :9])[None, None, :], ids[2, 8])[:, 0]  # last query of row 2
    torch.testing.assert_close(bias[2, :, 8], expected)


def _pairwise(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's pairs (i, i + D/2) rotated as the paper writes it."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_at(x: torch.Tensor, position: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    cos, sin = rope_cos_sin(position + 1, head_dim, base)
    return _pairwise(x[None], cos[position : position + 1], sin[position : position + 1])[0]


@fidelity("`pos_encoding: rope`")
def test_rope_score_depends_only_on_relative_position():
    head_dim = 16
    q, k = torch.randn(2, 1, head_dim, dtype=torch.float32).unbind(0)  # (1, D) each
    for m, n in [(5, 2), (9, 9), (3, 7)]:
        base_score = (_rope_at(q, m, head_dim) * _rope_at(k, n, head_dim)).sum()
        for shift in (1, 17, 300, 4000):
            shifted = (_rope_at(q, m + shift, head_dim) * _rope_at(k, n + shift, head_dim)).sum()
            torch.testing.assert_close(shifted, base_score, atol=2e-4, rtol=1e-4)
    # it does depend on the distance, or the test above would prove nothing
    near = (_rope_at(q, 5, head_dim) * _rope_at(k, 4, head_dim)).sum()
    far = (_rope_at(q, 5, head_dim) * _rope_at(k, 0, head_dim)).sum()
    assert not torch.isclose(near, far, atol=1e-3)


def test_rope_preserves_norms_and_rotates_in_float32(tiny_config):
    pe = RotaryPositions(dataclasses.replace(tiny_config, pos_encoding="rope"))
    q = torch.randn(2, 4, 40, 8)
    k = torch.randn(2, 4, 40, 8)
    q_rot, k_rot = pe.rotate(q, k)  # positions 0..39: past the 16 cached at init
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(k_rot.norm(dim=-1), k.norm(dim=-1))
    assert not torch.allclose(q_rot, q)
    assert pe.turn.size(0) >= 40 and pe.turn.dtype == torch.float32  # the cache grew, not cropped
    cos, sin = rope_cos_sin(40, 8, 10000.0)
    torch.testing.assert_close(q_rot, _pairwise(q, cos, sin), rtol=0, atol=0)  # the same float32 numbers


def test_rope_cache_stays_float32_after_casting_the_model(tiny_config):
    model = GPT(dataclasses.replace(tiny_config, pos_encoding="rope")).to(torch.bfloat16)
    assert model.pe.turn.dtype == torch.bfloat16  # what .to() does to every float buffer
    model(torch.randint(0, 64, (1, 8)))
    assert model.pe.turn.dtype == torch.float32


@fidelity(
    "`pos_encoding: sinusoidal`",
    paper="Vaswani et al. 2017, §3.5",
    code="none: the paper's formula",
    default="sin on even, cos on odd channels of pos/10000^(2i/C); tokens × √C (§3.4)",
    deviations="none",
)
def test_sinusoid_table_matches_the_formula():
    dim = 16
    table = sinusoid_table(100, dim)
    for pos in (0, 1, 7, 99):
        for i in (0, 1, 3, 7):
            angle = pos / 10000 ** (2 * i / dim)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)


@fidelity("`pos_encoding: sinusoidal`")
def test_sinusoidal_embedding_grows_and_adds_the_table(tiny_config):
    config = dataclasses.replace(tiny_config, pos_encoding="sinusoidal")
    pe = SinusoidalPositions(config)
    x = torch.randn(2, 60, config.n_embd)  # past the 16 positions at init
    out = pe.embed(x)
    expected = x * math.sqrt(config.n_embd) + sinusoid_table(60, config.n_embd)
    torch.testing.assert_close(out, expected)
    assert sum(p.numel() for p in pe.parameters()) == 0


@pytest.mark.parametrize(
    "scheme", [name for name, scheme in SCHEMES.items() if scheme.longest(GPTConfig()) is not None]
)
def test_a_scheme_with_a_longest_position_refuses_to_run_past_it(tiny_config, scheme):
    """Learned positions: block_size (16 here)."""
    model = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme))
    limit = model.pe.max_positions
    assert limit is not None
    model(torch.randint(0, 64, (1, limit)))  # exactly the limit is fine
    with pytest.raises(ValueError) as info:
        model(torch.randint(0, 64, (1, limit + 1)))
    message = str(info.value)
    assert str(limit) in message and "block_size" in message and str(limit + 1) in message


@fidelity(
    "`pos_encoding: t5`",
    paper="Raffel et al. 2020",
    code="T5's `_relative_position_bucket`, `bidirectional=False`",
    default="32 buckets (16 exact, log-spaced to 128), one table for all layers",
    deviations="table init N(0, 0.02²); T5 leaves scores unscaled: `attn_score dot`",
)
def test_t5_buckets_by_hand():
    """32 buckets, max distance 128: 0..15 exact; then 16 + floor(ln(d / 16) / ln(8) * 16), at most 31."""
    distances = torch.tensor([0, 1, 15, 16, 20, 32, 64, 100, 127, 128, 1000])
    # d=20: ln(1.25)/ln(8)*16 = 1.72 -> 17; d=32: 16/3 -> 21; d=64: 32/3 -> 26; d=100: 14.1 -> 30
    expected = [0, 1, 15, 16, 17, 21, 26, 30, 31, 31, 31]
    assert t5_bucket(distances).tolist() == expected
    # 8 buckets up to 20: 0..3 exact, then 4 + floor(ln(d / 4) / ln(5) * 4): d=8 -> 5, d=19 -> 7
    assert t5_bucket(torch.tensor([3, 4, 8, 19, 20, 50]), 8, 20).tolist() == [3, 4, 5, 7, 7, 7]


@fidelity("`pos_encoding: t5`")
def test_t5_bias_is_a_learned_table_lookup_that_saturates(tiny_config):
    config = dataclasses.replace(tiny_config, pos_encoding="t5", t5_num_buckets=8, t5_max_distance=20)
    pe = T5Bias(config)
    h = torch.arange(config.n_head)[:, None]
    for d, bucket in ((0, 0), (3, 3), (8, 5), (20, 7), (500, 7)):
        torch.testing.assert_close(
            pe.bias().formula(h, torch.tensor([[d]]), torch.tensor(d)), pe.table[bucket][:, None]
        )
    assert pe.lookup_parameters() == [pe.table]
    # the bias counts buckets from where each starts: `t5_bucket` at every distance, for other tables too
    for n, most in ((32, 128), (32, 256), (10, 37), (128, 2048)):
        pe = T5Bias(dataclasses.replace(config, t5_num_buckets=n, t5_max_distance=most))
        with torch.no_grad():
            pe.table.copy_(torch.arange(n, dtype=torch.float32)[:, None].expand(n, config.n_head))  # row = bucket
        d = torch.arange(3 * most)
        expected = t5_bucket(d.clamp(max=most), n, most).float()
        assert torch.equal(pe.bias().formula(torch.tensor(0), d, d), expected), (n, most)


@pytest.mark.parametrize(
    "backend",
    [
        name
        for name in CPU_KERNELS
        if KERNELS[name].term_gradients
        and (KERNELS[name].backward_devices is None or "cpu" in KERNELS[name].backward_devices)
    ],
)
def test_t5_gradients_reach_the_table(tiny_config, backend):
    from posgpt.model import GPT

    model = GPT(dataclasses.replace(tiny_config, pos_encoding="t5", attn_backend=backend))
    idx = torch.randint(0, tiny_config.vocab_size, (2, 40))  # past block_size: distances 0..39
    _, loss = model(idx, idx)
    loss.backward()
    grad = model.pe.table.grad
    assert grad is not None
    used = set(t5_bucket(torch.arange(40)).tolist())  # the buckets of distances 0..39 get gradients, no other
    assert {int(b) for b in torch.nonzero(grad.abs().sum(1)).flatten()} == used


# randomized positions (Ruoss et al. 2023): positions as a tensor


@pytest.mark.parametrize(
    ("scheme", "backend"), [(s, k) for s in POS_ENCODINGS for k in CPU_KERNELS if SCHEMES[s].terms <= KERNELS[k].terms]
)  # CoPE: eager only
def test_contiguous_positions_give_exactly_todays_logits(tiny_config, scheme, backend):
    model = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme, attn_backend=backend)).eval()
    idx = torch.randint(0, tiny_config.vocab_size, (3, 13))
    contiguous = torch.arange(13).expand(3, 13)
    with torch.no_grad():
        given, plain = model(idx, positions=contiguous)[0], model(idx)[0]
    if not KERNELS[backend].weights and model.pe.terms:  # a per-row (B, H, T, T) bias: a fused kernel (SDPA's
        torch.testing.assert_close(given, plain, rtol=1e-6, atol=1e-6)  # on a CPU) takes another path (rounding)
    else:
        assert torch.equal(given, plain)


@pytest.mark.parametrize("scheme", [name for name, scheme in SCHEMES.items() if scheme.learned_bias and
                                    Term.POSITIONS in scheme.terms])  # fmt: skip
def test_a_learned_table_trains_on_sdpa_on_cuda_not_through_flexs_atomics(scheme):
    """T5, Kerple, FIRE: flex's backward adds every pair's gradient into a few table entries with atomics (T5 at 0.02
    of RoPE's speed on an H100); training takes SDPA, whose dense bias carries the table's gradient back. Without
    gradients (evaluation) flex runs them still."""
    layer, pe, cuda = ATTENTIONS["softmax"], SCHEMES[scheme], torch.device("cuda")
    for needs_grad, expected in ((True, "sdpa"), (False, "flex")):
        needs = layer.needs(pe, AttentionMask(), SCORES["scaled_dot"], cuda, False, needs_grad)
        assert layer.choose_kernel("auto", needs, cuda) is KERNELS[expected]


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("scheme", [name for name in BIASES if SCHEMES[name].relative])
def test_a_relative_bias_formed_per_distance_has_the_gradients_of_one_formed_per_pair(tiny_config, scheme, whole,
                                                                                      monkeypatch):  # fmt: skip
    """Without positions given, a dense kernel forms a bias of the distance alone once per distance and spreads it
    over the pairs (no gather per pair, nor its scatter in the backward pass: how SDPA trains T5's and Kerple's
    tables on CUDA, where flex's backward would add each pair's gradient into them with atomics); given positions,
    per pair. A float64 model (its bias float32, as every scheme's), the bias formed whole and in blocks of rows."""
    if not whole:
        monkeypatch.setattr(dense, "DENSE_ELEMENTS", 64)
    model = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme, attn_backend="sdpa")).double()
    idx = torch.randint(0, tiny_config.vocab_size, (3, 13))
    grads = []
    for positions in (None, torch.arange(13).expand(3, 13)):
        model.zero_grad()
        model(idx, idx, positions=positions)[1].backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-9, msg=name)  # the bias is float32's


@pytest.mark.parametrize("scheme", POS_ENCODINGS)
def test_each_row_is_at_its_own_positions(tiny_config, scheme):
    """Shifting a row's positions changes nothing for a relative scheme and something for an
    absolute one; positions 0..T-1 given are what None computes."""
    model = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme, attn_backend="eager")).eval()
    idx = torch.randint(0, tiny_config.vocab_size, (2, 9))
    positions = torch.stack([torch.arange(9), torch.arange(9) + 5])  # row 1 shifted by 5
    with torch.no_grad():
        logits = model(idx, positions=positions)[0]
        plain = model(idx)[0]
    torch.testing.assert_close(logits[0], plain[0], rtol=0, atol=0)
    shifted = (logits[1] - plain[1]).abs().max()
    if model.pe.relative or not model.pe.uses_positions:  # only distances matter
        assert shifted < 1e-5
    else:
        assert shifted > 1e-3
    pe = model.pe
    x = torch.randn(2, 9, tiny_config.n_embd)
    torch.testing.assert_close(pe.embed(x, positions)[0], pe.embed(x[:1])[0], rtol=0, atol=0)
    q = torch.randn(2, 2, 9, tiny_config.head_dim)
    torch.testing.assert_close(pe.rotate(q, q, positions)[0][0], pe.rotate(q[:1], q[:1])[0][0], rtol=0, atol=0)


def test_a_random_position_draw_is_sorted_in_range_and_seeded():
    draw = random_positions(64, 20, 50, torch.Generator().manual_seed(3))
    assert draw.shape == (64, 20) and draw.dtype == torch.int64
    assert bool((draw[:, 1:] > draw[:, :-1]).all()) and int(draw.min()) >= 0 and int(draw.max()) < 50
    assert torch.equal(draw, random_positions(64, 20, 50, torch.Generator().manual_seed(3)))
    assert not torch.equal(draw, random_positions(64, 20, 50, torch.Generator().manual_seed(4)))
    counts = torch.bincount(draw.flatten(), minlength=50).float()  # every position about equally often
    assert counts.min() > 0.5 * counts.mean() and counts.max() < 1.5 * counts.mean()
    assert torch.equal(random_positions(2, 7, 7), torch.arange(7).expand(2, 7))  # all of them: contiguous
    with pytest.raises(ValueError, match="distinct positions"):
        random_positions(1, 8, 7)
