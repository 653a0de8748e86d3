"""What decoding keeps (the static KV cache, full and rolling, and linear attention's state) changes
nothing but speed and memory, for every scheme, mask, scaling, score, attention function and layer option; a
padded batch decodes each row as it would alone; a compiled decode step is one graph."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig
from posgpt.model.config import ROPE_SCALINGS
from posgpt.model.generation import compile_for_decoding, context_window, decode, pad_prompts
from posgpt.model.scores import SCORES

from helpers import layer_variants, scheme_kinds

MASKS: dict[str, dict[str, int]] = {
    "causal": {},
    "window": {"attn_window": 5},
    "window+sinks": {"attn_window": 5, "attn_sinks": 2},
    "bigbird": {"attn_window": 5, "attn_sinks": 1, "attn_random_blocks": 2, "attn_sparse_block": 4},
    "chunk": {"attn_chunk": 5},
}


def decoding_cases(config: GPTConfig) -> Iterator[Any]:
    """Every scheme with every mask for the first attention function (softmax), every scheme with
    the others and the masks with a rotation and a bias there; RoPE with every scaling, every score
    (with a rotation and a bias): each a pytest param, read from the registries."""
    fields: list[tuple[str, dict[str, Any]]] = []
    first = next(iter(ATTENTIONS))
    kinds = scheme_kinds()
    shown = (kinds["rotation"], kinds["fixed bias"])  # what a cache that drops or misplaces keys shows
    for function in ATTENTIONS:
        for scheme in SCHEMES:
            masks = MASKS if function == first or scheme in shown else {"causal": {}}
            if scheme not in shown:  # BigBird's cache is the full one: a rotation and a bias show it
                masks = {name: extra for name, extra in masks.items() if name != "bigbird"}
            fields += [(f"{function}-{scheme}-{mask}", {"attention": function, "pos_encoding": scheme, **extra})
                       for mask, extra in masks.items()]  # fmt: skip
    fields += [(f"{scheme}-{s}", {"pos_encoding": scheme, "rope_scaling": s, "rope_scaling_factor": 2.0})
               for scheme, declared in SCHEMES.items() if declared.rescalable
               for s in ROPE_SCALINGS if s != "none"]  # fmt: skip
    fields += [(f"{score}-{scheme}", {"attn_score": score, "pos_encoding": scheme})
               for score in SCORES if score != GPTConfig.attn_score for scheme in shown]  # fmt: skip
    rotation = {"pos_encoding": kinds["rotation"]}  # each layer option with each function, and with a rolling cache
    fields += [(f"{function}-{label}", {"attention": function, **rotation, **extra})
               for function in ATTENTIONS for label, extra in layer_variants(config).items()]  # fmt: skip
    fields += [(f"{label}-window+sinks", {**rotation, **MASKS["window+sinks"], **extra})
               for label, extra in layer_variants(config).items()]  # fmt: skip
    for name, extra in fields:
        try:
            yield pytest.param(dataclasses.replace(config, **extra), id=name)
        except ConfigError:  # a combination no kernel runs (linear attention with a bias or a window)
            continue


CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
CASES = list(decoding_cases(CONFIG))


def greedy(logits: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1, keepdim=True)


def run(model: GPT, idx: torch.Tensor, new: int, use_cache: bool, lengths: torch.Tensor | None = None, **kw):
    """Greedy decoding: (logits (B, new, V), tokens (B, new))."""
    steps = list(decode(model, idx, new, greedy, use_cache, lengths=lengths, **kw))
    return torch.stack([s[0] for s in steps], 1), torch.cat([s[1] for s in steps], 1)


@pytest.mark.parametrize("config", CASES)
def test_cached_decoding_gives_the_logits_and_tokens_of_no_cache(config):
    """Prompt 9 (longer than a window's 5 + 2 slots: a rolling prefill), then 12 tokens: the
    rolling buffer wraps, and every scheme with no longest position passes block_size; one with a longest
    position (learned: 16) slides past its window (a prefill of the last 16 each step)."""
    model = GPT(config).eval()
    prompt = torch.randint(0, config.vocab_size, (2, 9))
    cached_logits, cached = run(model, prompt, 12, use_cache=True)
    logits, tokens = run(model, prompt, 12, use_cache=False)
    assert torch.equal(cached, tokens)
    torch.testing.assert_close(cached_logits, logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", CASES)
def test_cached_steps_give_the_logits_of_one_full_forward(config):
    """A prompt, single tokens and a chunk of several through one cache: the logits of one forward
    over the whole sequence, at every position (past a window's wrap and block_size)."""
    model = GPT(config).eval()
    T = 16 if model.pe.max_positions is not None else 30
    idx = torch.randint(0, config.vocab_size, (2, T))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(T, batch=2, longest=T)
        pieces = [idx[:, :7], *idx[:, 7 : T - 6].split(1, dim=1), idx[:, T - 6 :]]
        steps = [model(piece, cache=cache)[0] for piece in pieces]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.pos.tolist() == [T, T]


@pytest.mark.parametrize("config", CASES)
def test_a_row_in_a_padded_batch_decodes_as_it_would_alone(config):
    """Prompts of 3 and 11 tokens in one batch, padded on the right (to 16: a bucket), then 8 tokens: each
    row's logits within 1e-5 of the row decoded alone (a scheme with a longest position: past it too), and its
    greedy tokens the same wherever the choice is clear."""
    model = GPT(config).eval()
    prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (3, 11)]
    idx, lengths = pad_prompts(prompts)
    batch_logits, batch_tokens = run(model, idx, 8, use_cache=True, lengths=lengths)
    for row, prompt in enumerate(prompts):
        alone_logits, alone_tokens = run(model, torch.tensor([prompt]), 8, use_cache=True)
        torch.testing.assert_close(batch_logits[row], alone_logits[0], atol=1e-5, rtol=1e-5)
        top2 = alone_logits[0].topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4
        assert torch.equal(batch_tokens[row][clear], alone_tokens[0][clear])


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_the_cache_holds_its_capacity_and_no_more(mask):
    """A window's rolling buffer holds S + W slots however long decoding runs (a chunk's C); a full cache (causal,
    or a window with random blocks) the capacity asked for."""
    model = GPT(dataclasses.replace(CONFIG, pos_encoding="alibi", **MASKS[mask])).eval()
    cache = model.new_cache(8, batch=2)
    prompt = torch.randint(0, 64, (2, 9))
    expected = model.kinds[0].mask.ring + model.kinds[0].mask.sinks if model.kinds[0].mask.rolling else 8
    assert cache.parts[0].capacity == expected  # random blocks reach any earlier key: a full cache
    if model.kinds[0].mask.rolling:
        assert context_window(model) is None  # constant memory: no window to slide
        with torch.no_grad():
            model(prompt, cache=cache)
            for _ in range(25):
                model(prompt[:, :1], cache=cache)
        assert cache.layers[0].kv.size(3) == expected
        assert cache.parts[0].slot_positions.min() >= 0 and cache.pos.tolist() == [34, 34]


def _counting_compile(model: GPT) -> list[object]:
    """Compile `model` with a backend that keeps each graph and asserts that no two of its inputs share memory:
    torch 2.11 runs no CUDA graph of a step whose inputs alias (the cache's views beside its buffer)."""
    graphs: list[object] = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        storages = [t.untyped_storage().data_ptr() for t in example_inputs if isinstance(t, torch.Tensor)]
        assert len(storages) == len(set(storages)), "two inputs of a compiled graph share memory"
        return gm.forward

    torch._dynamo.reset()
    compile_for_decoding(model, backend=counting)
    return graphs


STATIC_SHAPES = torch._dynamo.config.patch(automatic_dynamic_shapes=False)
"""No dynamic shapes while a test counts graphs. Torch's own patch, not pytest's monkeypatch: from
pytest 9.2 monkeypatch's undo deletes a setting of torch's config modules instead of restoring it,
and the next test that reads it fails with AttributeError."""


COMPILE_CASES = [  # a sample (each case is a compile): each decoding path once: a full cache, a rolling one (window
    # and sinks), linear attention's and the delta rule's states, BigBird's full cache with a sparse mask; each kind
    # of position code in the graph (a table with a longest position, a rotation with scaling, biases: T5's buckets,
    # FIRE's MLP per layer, none); each attention function (checked below); a score that is not a dot product. Every
    # scheme, function and score decodes uncompiled in the matrix above.
    {"pos_encoding": "learned", "attention": "stick_breaking"},
    {"pos_encoding": "rope", "rope_scaling": "yarn", "rope_scaling_factor": 2.0, **MASKS["window+sinks"],
     "attention": "differential", "attn_log_scaling": "learned"},
    {"pos_encoding": "t5", "attn_score": "additive", "attention": "forgetting"},
    {"pos_encoding": "none", "attention": "linear"},
    {"pos_encoding": "none", "attention": "gated_deltanet"},
    {"pos_encoding": "sinusoidal", "attention": "kda"},
    {"pos_encoding": "rope", "n_layer": 2, "layout": ("delta", "softmax"),  # a hybrid: a state and a KV cache
     "kinds": {"delta": {"attention": "gated_deltanet"}, "softmax": {"qk_norm": "gemma3"}}},
    {"pos_encoding": "fire", "fire_per_layer": True, "fire_width": 4, "n_layer": 2, **MASKS["bigbird"],
     "attention": "sigmoid"},
    {"pos_encoding": "rope", "n_layer": 2, "n_kv_head": 2, "qk_norm": "llama4", "attn_sink_logits": True,
     "layout": ("local", "global"), "kinds": {"local": {"attn_chunk": 6}, "global": {"pos_encoding": "none",
                                                                                     "attn_temperature_floor": 8}}},
]  # fmt: skip


def test_the_compile_sample_holds_every_attention_function():
    """A function registered later joins a case of the sample (each case is a compile: no case of its own)."""
    assert {fields.get("attention", GPTConfig.attention) for fields in COMPILE_CASES} == set(ATTENTIONS)


@pytest.mark.slow
@pytest.mark.parametrize("fields", COMPILE_CASES, ids=lambda f: "-".join(str(v) for v in f.values()))
@STATIC_SHAPES
def test_compiled_generation_is_one_prefill_and_one_decode_graph(fields):
    """No dynamic shapes and a counting backend (no inductor), one layer (the graphs are the model's,
    not a layer's; FIRE per layer: two): 40 new tokens after a 4-token prompt, past block_size 16 for the
    schemes that extrapolate (a cache of 64, whose position tables grow before decoding), compile the
    prefill and the decode step; another generation of the same cache size compiles nothing more.
    A scheme with a longest position (learned: block 16): 8 tokens, then 40 past the window, whose every
    step is a prefill of the last 16 tokens: a third graph only."""
    model = GPT(dataclasses.replace(CONFIG, **{"n_layer": 1, **fields})).eval()
    graphs = _counting_compile(model)
    prompt = torch.randint(0, CONFIG.vocab_size, (1, 4))
    bounded = model.pe.max_positions is not None
    model.generate(prompt, 8 if bounded else 40, temperature=0, max_context=64)
    assert len(graphs) <= 2
    model.generate(prompt, 40 if bounded else 30, temperature=0, max_context=64)  # a new cache of the same size
    assert len(graphs) <= (3 if bounded else 2)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_decodes_the_tokens_of_eager():
    """The one real compile of the suite's decoding: a tiny ALiBi model trained 20 steps to count
    (so greedy choices are clear, not near-ties of random weights), compiled for decoding by
    Inductor, gives eager's greedy tokens."""
    model = GPT(dataclasses.replace(CONFIG, block_size=32, n_layer=1, pos_encoding="alibi"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counting = torch.arange(CONFIG.vocab_size).repeat(5)
    for _ in range(20):
        starts = torch.randint(0, counting.numel() - 33, (8,))
        x = torch.stack([counting[s : s + 32] for s in starts.tolist()])
        y = torch.stack([counting[s + 1 : s + 33] for s in starts.tolist()])
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
    model.eval()
    prompt = torch.tensor([[5, 6, 7]])
    eager = model.generate(prompt, 40, temperature=0)
    torch._dynamo.reset()
    compile_for_decoding(model)
    assert torch.equal(model.generate(prompt, 40, temperature=0), eager)
    assert torch.equal(eager[0, 3:13], torch.arange(8, 18))  # it learned to count: the test can fail
    torch._dynamo.reset()


def test_what_does_not_fit_is_refused_not_dropped():
    """A chunk past a full cache's capacity, and lengths outside 1..T, are errors, not wrong logits;
    prompts padded wider than they need still decode."""
    model = GPT(dataclasses.replace(CONFIG, pos_encoding="rope")).eval()
    cache = model.new_cache(8, batch=1)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="holds 8 positions; 10 do not fit"):
            model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="counts in 1..4"):
            model(torch.zeros(2, 4, dtype=torch.long), lengths=torch.tensor([5, 1]))
    wide = torch.zeros(2, 8, dtype=torch.long)
    assert len(list(decode(model, wide, 2, greedy, lengths=torch.tensor([3, 2])))) == 2


@STATIC_SHAPES
def test_uncached_compiled_generation_compiles_a_few_widths_only():
    """Without a cache every token is a forward over the whole context: its widths are bucketed
    like a prefill's, so a compiled model traces log2(length) graphs, not one per token."""
    model = GPT(dataclasses.replace(CONFIG, n_layer=1, pos_encoding="alibi")).eval()
    graphs = _counting_compile(model)
    model.generate(torch.randint(0, CONFIG.vocab_size, (1, 3)), 24, temperature=0, use_cache=False)
    assert len(graphs) <= 4  # widths 4, 8, 16, 32 for 24 forwards
    torch._dynamo.reset()
