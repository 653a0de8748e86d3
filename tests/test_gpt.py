"""The GPT as a whole: shapes, loss, parameter and FLOP counts, init, tying, and that it learns."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from posgpt.model import GPT, POS_ENCODINGS, SCHEMES, GPTConfig

from helpers import overfit, uncompiled_flex


@pytest.mark.parametrize("scheme", POS_ENCODINGS)
def test_forward_shapes_and_loss(tiny_config, scheme):
    model = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme))
    idx = torch.randint(0, 64, (3, 11))
    logits, loss = model(idx)
    assert logits.shape == (3, 11, 64) and loss is None
    targets = torch.randint(0, 64, (3, 11))
    targets[0, :4] = -1
    targets[2, -1] = -1
    logits, loss = model(idx, targets)
    keep = targets != -1
    expected = F.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("scheme", [name for name, scheme in SCHEMES.items() if scheme.longest(GPTConfig()) is None])
def test_extrapolating_schemes_run_at_four_times_block_size(tiny_config, scheme):
    model = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)).eval()
    idx = torch.randint(0, 64, (1, 4 * tiny_config.block_size))
    with torch.no_grad():
        logits, _ = model(idx)
        short, _ = model(idx[:, : tiny_config.block_size])
    assert logits.shape == (1, 64, 64) and torch.isfinite(logits).all()
    # the first block_size positions are computed exactly as in a short forward: nothing cropped
    torch.testing.assert_close(logits[:, : tiny_config.block_size], short, atol=1e-5, rtol=1e-5)


def _expected_params(c: GPTConfig, with_learned_table: bool) -> int:
    C = c.n_embd
    per_block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    total = c.vocab_size * C + c.n_layer * per_block + 2 * C  # tied head adds nothing
    return total + (c.block_size * C if with_learned_table else 0)


def test_num_params_and_flops_per_token(tiny_config):
    learned = GPT(dataclasses.replace(tiny_config, pos_encoding="learned"))
    assert learned.num_params(exclude_embeddings=False) == _expected_params(tiny_config, True)
    assert learned.num_params(exclude_embeddings=True) == _expected_params(tiny_config, False)
    for scheme in SCHEMES:  # every scheme without parameters of its own adds none
        model = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme))
        if not list(model.pe.parameters()):
            assert model.num_params(exclude_embeddings=False) == _expected_params(tiny_config, False), scheme
    n = _expected_params(tiny_config, False)
    L, H, Q = tiny_config.n_layer, tiny_config.n_head, tiny_config.head_dim
    assert learned.flops_per_token(256) == 6 * n + 12 * L * H * Q * 256


def test_gpt2_small_has_124m_parameters():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50257))
    assert model.config.padded_vocab_size == 50304  # embedding rows, a multiple of 64 (nanoGPT's padding)
    # GPT-2 small as published (124,439,808), plus the 47 padding rows of the tied embedding
    assert model.num_params(exclude_embeddings=False) == 124_439_808 + 47 * 768


def test_padded_vocab_size_pads_large_vocabularies_only():
    sizes = {65: 65, 256: 256, 257: 320, 50257: 50304, 50304: 50304, 100277: 100288}
    for vocab, padded in sizes.items():
        assert GPTConfig(vocab_size=vocab).padded_vocab_size == padded


def test_init_ties_embeddings_and_scales_residual_projections():
    config = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256)
    model = GPT(config)
    assert model.lm_head.weight is model.wte.weight
    residual_std = 0.02 / (2 * config.n_layer) ** 0.5
    for block in model.blocks:
        assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.03)
        assert block.mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.03)
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.03)
        assert torch.all(block.attn.qkv.bias == 0) and torch.all(block.ln_1.weight == 1)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.03)


def test_no_bias_config_has_no_biases(tiny_config):
    model = GPT(dataclasses.replace(tiny_config, bias=False))
    assert all(name.endswith("weight") for name, _ in model.named_parameters())


def test_dropout_is_active_in_train_mode_only(tiny_config):
    model = GPT(dataclasses.replace(tiny_config, dropout=0.3))
    idx = torch.randint(0, 64, (2, 16))
    model.train()
    assert not torch.allclose(model(idx)[0], model(idx)[0])
    model.eval()
    torch.testing.assert_close(model(idx)[0], model(idx)[0])


@pytest.mark.parametrize("scheme", POS_ENCODINGS)
def test_each_scheme_overfits_one_batch(tiny_config, scheme):
    """Gradients reach every part of the model: a fixed batch of random tokens gets memorised."""
    first, final = overfit(GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)), steps=60, lr=1e-2)
    assert first > 3.5  # about ln(64) = 4.16 at init
    assert final < 0.1, f"{scheme}: loss {first:.3f} -> {final:.3f}"  # from ~4.16


def test_last_only_gives_the_last_row_of_the_full_logits(tiny_config):
    model = GPT(tiny_config).eval()
    idx = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        full, _ = model(idx)
        last, _ = model(idx, last_only=True)
    assert last.shape == (2, 1, 64)
    torch.testing.assert_close(last, full[:, -1:])


def test_hidden_states_through_the_head_are_the_logits(tiny_config):
    model = GPT(dataclasses.replace(tiny_config, pos_encoding="alibi")).eval()
    idx = torch.randint(0, tiny_config.vocab_size, (2, 40))
    with torch.no_grad():
        logits, _ = model(idx)
        assert torch.allclose(model.lm_head(model.hidden_states(idx)), logits, atol=1e-6)


def test_a_rescaled_view_equals_a_model_built_with_the_scaling_and_leaves_the_model_alone(tiny_config):
    model = GPT(dataclasses.replace(tiny_config, pos_encoding="rope")).eval()
    scaled = GPT(dataclasses.replace(model.config, rope_scaling="yarn", rope_scaling_factor=4.0)).eval()
    scaled.load_state_dict(model.state_dict())
    idx = torch.randint(0, tiny_config.vocab_size, (2, 64))
    with torch.no_grad():
        plain = model(idx)[0]
        view = model.rescaled("yarn", 4.0)
        assert view.config.rope_scaling == "yarn" and torch.allclose(view(idx)[0], scaled(idx)[0], atol=1e-6)
        assert not torch.allclose(view(idx)[0], plain, atol=1e-4)
        assert model.config.rope_scaling == "none" and model.pe is not view.pe
        assert torch.equal(model(idx)[0], plain)  # the model itself is as it was
    assert view.wte.weight is model.wte.weight and view.blocks is model.blocks  # shared, not copied
    assert dict(view.named_parameters()).keys() == dict(model.named_parameters()).keys()
    with pytest.raises(ValueError, match="has no scaling; RoPE has"):
        GPT(tiny_config).rescaled("linear", 2.0)


@pytest.mark.parametrize("extra", [{"pos_encoding": "rope"}, {"pos_encoding": "alibi", "attn_backend": "flex"}])
def test_a_copied_or_unpickled_model_runs_as_the_original(monkeypatch, tiny_config, extra, tmp_path):
    """What Lightning's ddp_spawn (pickling), SWA and EMA (deep copies) do to a model."""
    uncompiled_flex(monkeypatch)  # flex's block-mask memo copied too (compiled flex is refused on a CPU)
    model = GPT(dataclasses.replace(tiny_config, **extra)).eval()
    idx = torch.randint(0, tiny_config.vocab_size, (2, 13))
    torch.save(model, tmp_path / "model.pt")
    copies = [copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)]
    with torch.no_grad():
        expected = model(idx)[0]
        for other in copies:
            torch.testing.assert_close(other(idx)[0], expected, rtol=0, atol=0)


def test_a_sequence_past_learned_positions_names_every_scheme_without_that_limit(tiny_config):
    model = GPT(dataclasses.replace(tiny_config, pos_encoding="learned"))
    with pytest.raises(ValueError, match="can encode at most") as info:
        model(torch.zeros(1, tiny_config.block_size + 1, dtype=torch.long))
    unlimited = [name for name, scheme in SCHEMES.items() if scheme.longest(tiny_config) is None]
    assert str(info.value).endswith(f"({', '.join(unlimited)}).")
