"""What decoding keeps: the KV cache (full, and rolling with a window and sinks) and linear
attention's state change nothing but speed and memory, and a compiled decoding step is traced once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import GPT, POS_ENCODINGS, GPTConfig
from model.cache import KVCache
from model.generation import context_window

MASKS = {"window": {"attn_window": 5}, "window+sinks": {"attn_window": 5, "attn_sinks": 2}}


def _model(tiny_config: GPTConfig, scheme: str, **extra) -> GPT:
    return GPT(dataclasses.replace(tiny_config, pos_encoding=scheme, **extra)).eval()


@pytest.mark.parametrize("scheme", POS_ENCODINGS)
def test_greedy_with_cache_equals_without_token_for_token(tiny_config, scheme):
    """block_size 16, window 64 (16 for learned): 5 + 75 tokens cross block_size, and the window
    slide for every scheme (learned slides at 16, the others at max_context = 4 x 16)."""
    model = _model(tiny_config, scheme)
    prompt = torch.randint(0, 64, (3, 5))
    cached = model.generate(prompt, 75, temperature=0, use_cache=True)
    uncached = model.generate(prompt, 75, temperature=0, use_cache=False)
    assert cached.shape == (3, 80)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned"])
def test_cached_logits_equal_a_full_forward(tiny_config, scheme):
    """Prompt then one token at a time through the cache: the same logits as one full forward, at
    every position, including past block_size for the schemes that allow it."""
    model = _model(tiny_config, scheme)
    T = 16 if scheme == "learned" else 40
    idx = torch.randint(0, 64, (2, T))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(tiny_config.n_layer, T)
        steps = [model(idx[:, :7], cache=cache)[0]]
        steps += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(7, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == T


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("scheme", POS_ENCODINGS)
def test_cached_decoding_equals_uncached_and_the_cache_stays_small(tiny_config, scheme, mask):
    model = _model(tiny_config, scheme, **MASKS[mask])
    prompt = torch.randint(0, tiny_config.vocab_size, (2, 9))  # longer than the window: a rolling prefill
    cached = model.generate(prompt, 30, temperature=0)
    uncached = model.generate(prompt, 30, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    if model.pe.max_positions is None:
        assert context_window(model) is None  # constant memory: no window to slide
    cache = KVCache(model.config.n_layer, 0, model.mask)
    steps = 25 if model.pe.max_positions is None else model.pe.max_positions - prompt.size(1)
    with torch.no_grad():
        model(prompt, cache=cache)
        for _ in range(steps):
            model(prompt[:, :1], cache=cache)
            assert cache.layers[0].k.size(2) == model.mask.window + model.mask.sinks  # never more than W + S


@pytest.mark.parametrize(("scheme", "extra"), [("rope", {}), ("alibi", {}), ("rope", {"attn_window": 6})])
def test_compiled_decoding_does_not_recompile_as_the_cache_grows(tiny_config, scheme, extra):
    """sample.py --compile: with the cache allocated up front and the position tables reserved,
    the one-token step is traced once and serves every cache length (a counting backend: no
    inductor, so the test takes seconds). A full cache's prompt is one more graph; a window's
    rolling prefill breaks into several (its eviction is data-dependent), but only once."""
    model = _model(tiny_config, scheme, **extra)
    graphs: list[object] = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.compile(backend=counting, dynamic=True)
    prompt = torch.randint(0, tiny_config.vocab_size, (1, 4))
    model.generate(prompt, 40, temperature=0)  # cache lengths 4..43, within 4 x block_size = 64
    first = len(graphs)
    model.generate(prompt, 20, temperature=0)  # a new cache, shorter
    assert len(graphs) == first  # no cache length, and no new cache, compiles anything again
    if not extra:
        assert first <= 2  # the prompt and the one-token step
    torch._dynamo.reset()
