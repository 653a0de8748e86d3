"""RoPE's scalings (`rope_scaling`: position interpolation, NTK, YaRN): each against its formula and its reference
code's numbers, and a factor of 1 changing nothing for every rescalable scheme."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.model import GPT, SCHEMES, GPTConfig
from posgpt.model.config import ROPE_SCALINGS
from posgpt.model.positions.tables import rope_cos_sin, yarn_correction_range

from helpers import fidelity


@pytest.mark.parametrize("scaling", [s for s in ROPE_SCALINGS if s != GPTConfig.rope_scaling])
@pytest.mark.parametrize("scheme", [name for name, scheme in SCHEMES.items() if scheme.rescalable])
def test_rope_scaling_with_factor_one_changes_nothing(tiny_config, scheme, scaling):
    plain = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)).eval()
    scaled = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme, rope_scaling=scaling, rope_scaling_factor=1.0))
    scaled.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(scaled.eval()(idx)[0], plain(idx)[0])


@fidelity(
    "`rope_scaling: linear`",
    paper="Chen et al. 2023 (PI)",
    code="Hugging Face `linear` rope type",
    default="off (`none`); θᵢ / s",
    deviations="none",
)
def test_linear_scaling_is_position_interpolation():
    cos, sin = rope_cos_sin(64, 16, 10000.0, scaling="linear", factor=4.0, trained_length=16)
    ref_cos, ref_sin = rope_cos_sin(16, 16, 10000.0)
    torch.testing.assert_close(cos[::4], ref_cos)  # position 4p scaled == position p unscaled
    torch.testing.assert_close(sin[::4], ref_sin)


@fidelity(
    "`rope_scaling: ntk`",
    paper="bloc97 2023 (NTK-aware)",
    code="bloc97's base rule b·s^(D/(D−2)); Hugging Face `dynamic` for the per-length form",
    default="off; base raised by s^(D/(D−2))",
    deviations="s per evaluation length with `--rope_scaling_factor dynamic` (the evaluation default)",
)
def test_ntk_scaling_raises_the_base():
    cos, _ = rope_cos_sin(50, 16, 10000.0, scaling="ntk", factor=4.0, trained_length=16)
    ref_cos, _ = rope_cos_sin(50, 16, 10000.0 * 4.0 ** (16 / 14))
    torch.testing.assert_close(cos, ref_cos)
    # the highest frequency (pair 0) is untouched, the lowest is slowed by the full factor
    plain, _ = rope_cos_sin(50, 16, 10000.0)
    torch.testing.assert_close(cos[:, 0], plain[:, 0])


@fidelity(
    "`rope_scaling: yarn`",
    paper="Peng et al. 2023",
    code="YaRN reference code (`find_correction_range`, linear ramp), Hugging Face `_compute_yarn_parameters`",
    default="off; ramp in the pair index between ⌊i(32)⌋ and ⌈i(1)⌉, cos and sin × (0.1 ln s + 1)",
    deviations="none",
)
def test_yarn_correction_range_is_the_reference_codes():
    # i(r) = D ln(L / (2 pi r)) / (2 ln b), low = floor(i(32)), high = ceil(i(1)), clamped to [0, D - 1]
    # D=32, L=256, b=1e4: i(32) = 32 ln(1.2732) / 18.4207 = 0.4196 -> 0; i(1) = 32 ln(40.744) / 18.4207 = 6.440 -> 7
    assert yarn_correction_range(32, 10000.0, 256) == (0, 7)
    # Llama 2 (D=128, L=4096, b=1e4), the YaRN paper's model: i(32) = 20.95 -> 20, i(1) = 45.03 -> 46
    assert yarn_correction_range(128, 10000.0, 4096) == (20, 46)
    # D=64, L=256: i(32) = 0.839 -> 0, i(1) = 12.88 -> 13
    assert yarn_correction_range(64, 10000.0, 256) == (0, 13)


@fidelity("`rope_scaling: yarn`")
def test_yarn_frequencies_ramp_linearly_in_the_pair_index():
    head_dim, trained, factor = 32, 256, 4.0
    cos, sin = rope_cos_sin(300, head_dim, 10000.0, scaling="yarn", factor=factor, trained_length=trained)
    mscale = 0.1 * math.log(4.0) + 1.0  # 1.138629...
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, mscale**2))
    angle = torch.atan2(sin[1], cos[1]).double()  # position 1: the angle is the frequency itself
    # worked out by hand from the range (0, 7): weight w_i = min(i / 7, 1) of theta_i / 4 against theta_i
    theta = [10000.0 ** (-i / 16) for i in range(16)]
    expected = [t * (1 - min(i / 7, 1)) + t / 4 * min(i / 7, 1) for i, t in enumerate(theta)]
    torch.testing.assert_close(angle, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0)
    assert expected[0] == theta[0] and expected[7] == theta[7] / 4 and expected[15] == theta[15] / 4
    # pair 3: w = 3/7, theta_3 = 1e4^(-3/16) = 0.177828; 0.177828 * (4/7 + 3/28) = 0.120669
    assert angle[3].item() == pytest.approx(0.120669, rel=1e-5)


def test_rope_scaling_is_validated():
    from posgpt.model import GPTConfig

    with pytest.raises(ValueError, match="rope_scaling"):
        GPTConfig(rope_scaling="dynamic")
    with pytest.raises(ValueError, match="rope_scaling_factor must be >= 1"):
        GPTConfig(rope_scaling="linear", rope_scaling_factor=0.5)


def test_yarn_at_evaluation_reaches_only_the_kinds_that_do_not_pin_their_rope_scaling():
    """OLMo 3's rule: YaRN on the global layers only. The local kind pins rope_scaling none; after `rescaled`, its
    layers' actual rotation is the trained one, the global layers' is YaRN's (read from the schemes, not the config)."""
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, pos_encoding="rope",
                       layout=("local", "global"), kinds={"local": {"attn_window": 4, "rope_scaling": "none"},
                                                          "global": {}})  # fmt: skip
    model = GPT(config)
    view = model.rescaled("yarn", 4.0)
    trained = model.pe_of(model.kinds[0]).rotation(48)
    local, global_ = (view.pe_of(kind).rotation(48) for kind in view.kinds)
    torch.testing.assert_close(local, trained)
    assert not torch.allclose(global_, trained)
    yarn = GPT(dataclasses.replace(config, layout=None, kinds=None, rope_scaling="yarn", rope_scaling_factor=4.0))
    torch.testing.assert_close(global_, yarn.pe.rotation(48))
