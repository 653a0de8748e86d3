"""The attention layers: one class per attention function, chosen from `config.attention`; what each
declares (kernels, cache, constant memory); linear attention's layer; and combinations no kernel can
run, refused when the config is validated, in one line naming the settings and what would work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig
from posgpt.model.attention import LinearAttention, SoftmaxAttention
from posgpt.model.attention.linear import LayerStateCache
from posgpt.model.cache import CachePart, KVCache
from posgpt.model.kernels import KERNELS, Placement, Plan
from posgpt.model.masks import AttentionMask

from helpers import fidelity, overfit

ROOT = Path(__file__).resolve().parents[1]
LINEAR_SCHEMES = [name for name, scheme in SCHEMES.items() if not scheme.terms]
"""The schemes linear attention runs with (a score bias needs the scores it never forms): read from the registry."""


def _linear(tiny_config: GPTConfig, scheme: str, **extra) -> GPTConfig:
    return dataclasses.replace(tiny_config, pos_encoding=scheme, attention="linear", **extra)


def test_blocks_are_built_from_the_attention_function(tiny_config):
    for name, layer in ATTENTIONS.items():
        model = GPT(dataclasses.replace(tiny_config, attention=name))
        assert model.kinds[0].attention is layer and all(type(block.attn) is layer for block in model.blocks)
    assert isinstance(GPT(tiny_config).new_cache(8, batch=2).parts[0], KVCache)
    state = GPT(_linear(tiny_config, "rope")).new_cache(8, batch=2)  # linear attention keeps a state, no keys
    assert type(state.parts[0]) is CachePart and all(type(layer) is LayerStateCache for layer in state.layers)
    window = AttentionMask(window=4)
    assert SoftmaxAttention.constant_memory(tiny_config, window)
    assert not SoftmaxAttention.constant_memory(tiny_config, AttentionMask())
    cope = GPT(dataclasses.replace(tiny_config, pos_encoding="cope", attn_window=4))  # counts its keys in order
    kind = cope.kinds[0]
    assert not kind.attention.constant_memory(cope.config, kind.mask) and not cope.new_cache(8).parts[0].rolling
    assert LinearAttention.constant_memory(tiny_config, AttentionMask())


@pytest.mark.parametrize("scheme", LINEAR_SCHEMES)
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


@fidelity("`attention: linear`")
def test_rope_in_the_numerator_depends_on_relative_positions_only(tiny_config):
    """RoFormer's linear attention: R_i phi(q) . R_j phi(k) depends on j - i, the denominator on no
    position, so shifting every position leaves the layer's output unchanged."""
    model = GPT(_linear(tiny_config, "rope", n_layer=1)).eval()
    attention = model.blocks[0].attn
    x = torch.randn(1, 9, tiny_config.n_embd)
    outs = []
    for start in (0, 7):  # the 9 tokens at positions 0..8, then at 7..15 (no earlier tokens either time)
        step = Placement(9, tiny_config.n_head, x.device, torch.arange(start, start + 9)[None])
        with torch.no_grad():
            outs.append(attention(x, model.pe, Plan(LinearAttention.kernels["eager"], None, step)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_a_linear_attention_model_overfits_a_batch(tiny_config):
    _, final = overfit(GPT(_linear(tiny_config, "rope")), steps=60, lr=1e-2)
    assert final < 0.3


DROPPING = [name for name, kernel in KERNELS.items() if kernel.dropout]
"""Softmax attention's kernels with attention dropout (eager, sdpa)."""


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"attention": "linear", "pos_encoding": "alibi"},
         ["attention='linear' cannot run pos_encoding='alibi'", "a position score bias",
          "pos_encoding learned, sinusoidal, rope or none would run", "attention softmax"]),
        ({"attention": "linear", "pos_encoding": "t5"}, ["cannot run pos_encoding='t5'", "attention softmax"]),
        ({"attention": "linear", "attn_window": 4},
         ["cannot run attn_window=4", "a mask beyond causal", "attn_window 0 would run"]),
        ({"attention": "linear", "attn_backend": "sdpa"},
         ["attn_backend='sdpa' is not a kernel of attention='linear'", "auto, eager, chunked",
          "attention softmax"]),
        ({"attention": "linear", "attn_score": "dot"},
         ["attention='linear' cannot run attn_score='dot'", "scores no query-key pairs",
          "attn_score scaled_dot would run", "attention softmax"]),
        ({"attn_backend": "sdpa", "attn_score": "additive"},
         ["attn_backend='sdpa' cannot run attn_score='additive'", "attn_score scaled_dot, dot or general would run",
          "attn_backend auto or eager would run"]),
        ({"attn_backend": "flex", "dropout": 0.1},
         ["attn_backend='flex' cannot run dropout=0.1", "attention dropout", "dropout 0.0 would run",
          f"attn_backend {', '.join(['auto', *DROPPING[:-1]])} or {DROPPING[-1]} would run"]),
    ],
)  # fmt: skip
def test_a_combination_no_kernel_runs_is_refused_at_validation_in_one_line(tiny_config, fields, needles):
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(tiny_config, **fields)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_train_refuses_such_a_combination_before_preparing_any_data(tmp_path, text_file, capsys):
    import train as train_script
    from posgpt.core import cli

    argv = ["--model.attention", "linear", "--model.pos_encoding", "alibi", "--data.input", str(text_file),
            "--data.prepared_root", str(tmp_path / "prepared"), "--train.out_dir", str(tmp_path / "runs")]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        cli.run(train_script.COMMAND, argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "attention='linear' cannot run pos_encoding='alibi'" in lines[0], err
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "runs").exists()
