"""Sampling: windows slide as documented, filters hold, seeds reproduce (the caches are in test_cache.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posgpt.model import GPT, GPTConfig
from posgpt.model.generation import compile_for_decoding, context_window, filter_logits, hashed_noise, next_token


def _model(tiny_config, scheme: str) -> GPT:
    return GPT(dataclasses.replace(tiny_config, pos_encoding=scheme)).eval()


def test_window_is_block_size_for_learned_and_max_context_for_the_others(tiny_config):
    assert context_window(_model(tiny_config, "learned")) == 16
    assert context_window(_model(tiny_config, "learned"), max_context=100) == 16
    assert context_window(_model(tiny_config, "rope")) == 16  # the training length (issue 57: 4 x, gibberish)
    assert context_window(_model(tiny_config, "alibi"), max_context=24) == 24


def test_generation_past_max_context_sees_only_the_last_window(tiny_config):
    """With max_context 24, the token after 30 tokens depends on the last 24 only."""
    model = _model(tiny_config, "rope")
    a = torch.randint(0, 64, (1, 30))
    b = a.clone()
    b[:, :6] = (b[:, :6] + 1) % 64  # differs only outside the window
    out_a = model.generate(a, 1, temperature=0, max_context=24)
    out_b = model.generate(b, 1, temperature=0, max_context=24)
    assert out_a[0, -1] == out_b[0, -1]
    with torch.no_grad():
        expected = model(a[:, -24:])[0][:, -1].argmax(-1)
    assert out_a[0, -1] == expected


def test_same_seed_same_sample_and_batched_rows_differ(tiny_config):
    model = _model(tiny_config, "alibi")
    prompt = torch.zeros(4, 1, dtype=torch.long)
    one = model.generate(prompt, 30, temperature=1.0, generator=torch.Generator().manual_seed(3))
    two = model.generate(prompt, 30, temperature=1.0, generator=torch.Generator().manual_seed(3))
    other = model.generate(prompt, 30, temperature=1.0, generator=torch.Generator().manual_seed(4))
    assert torch.equal(one, two) and not torch.equal(one, other)
    assert len({tuple(row.tolist()) for row in one}) > 1  # several samples of one prompt


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15]])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).tolist() == [[False, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.75)).tolist() == [[False, True, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.81)).tolist() == [[False, True, True, True]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).tolist() == [[False, True, False, False]]
    # renormalised, the kept tokens keep their relative odds
    filtered = torch.softmax(filter_logits(logits, top_p=0.75), -1)
    torch.testing.assert_close(filtered[0, 1:3], torch.tensor([0.5, 0.3]) / 0.8)


def test_sampled_tokens_never_leave_the_allowed_set():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50)
    allowed = torch.isfinite(filter_logits(logits / 1.3, top_k=5, top_p=0.6))  # temperature first, as sampled
    assert (allowed.sum(-1) < 5).any()  # top_p binds for some rows, so both filters are exercised
    for _ in range(20):
        tokens = next_token(logits, temperature=1.3, top_k=5, top_p=0.6, generator=gen)
        assert allowed.gather(1, tokens).all()


def test_the_exponential_race_over_hashed_noise_draws_each_token_with_its_probability():
    """A compiled step samples by argmax p / E, E the seed's hashed Exponential(1) draws: over 4000 positions the
    draws have mean and deviation 1, and each token comes up at its probability (a binomial's 4 sigma)."""
    positions, probs = torch.arange(4000), torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    noise = hashed_noise(torch.tensor([7]), positions, probs.numel())
    assert noise.min() > 0 and abs(noise.mean() - 1) < 0.03 and abs(noise.std() - 1) < 0.05
    tokens = next_token(probs.log().expand(len(positions), -1), noise=noise)[:, 0]
    counts = torch.bincount(tokens, minlength=probs.numel()) / len(positions)
    sigma = (probs * (1 - probs) / len(positions)).sqrt()
    assert ((counts - probs).abs() <= 4 * sigma).all(), counts.tolist()
    assert torch.equal(noise, hashed_noise(torch.tensor([7]), positions, probs.numel()))  # a seed, its draws
    assert not torch.equal(noise, hashed_noise(torch.tensor([8]), positions, probs.numel()))


def test_compiled_sampling_draws_inside_the_graph_the_same_tokens_for_a_seed(tiny_config):
    """compile_for_decoding traces the pick of the next token into the step (Dynamo, no generator in the graph):
    two graphs for any number of tokens and seeds; a seed gives its tokens again, another seed others; greedy
    decoding gives eager's tokens."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, prompt = (
        _model(tiny_config, "rope"),
        torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(0)),
    )
    greedy = model.generate(prompt, 12, temperature=0)
    torch._dynamo.reset()
    compile_for_decoding(model, backend=counting)
    assert torch.equal(model.generate(prompt, 12, temperature=0), greedy)

    def sampled(seed: int) -> torch.Tensor:
        return model.generate(prompt, 12, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(seed))

    first = sampled(1)
    assert torch.equal(sampled(1), first) and not torch.equal(sampled(2), first)
    assert len(graphs) == 4  # greedy's prefill and decode step, and the sampled ones
    for seed in range(1785, 1795):  # 1790 drew a noise of exactly 0 when the uniform had 24 bits (+ 0.5 rounded to 1)
        only = model.generate(prompt, 12, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(only, greedy), seed  # top-k 1 leaves one token to draw: never a filtered one
    torch._dynamo.reset()


def test_empty_prompt_is_refused_with_a_hint(tiny_config):
    with pytest.raises(ValueError, match="at least one token"):
        _model(tiny_config, "rope").generate(torch.zeros(1, 0, dtype=torch.long), 3)


def test_the_sampler_never_draws_a_padding_row():
    config = GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config).eval()
    assert config.padded_vocab_size == 320
    with torch.no_grad():  # make the padding rows by far the most likely outputs
        model.wte.weight[300:] = 10 * model.ln_f(model.wte.weight[:1].expand(20, -1)).sign()
    idx = torch.zeros(4, 3, dtype=torch.long)
    logits, _ = model(idx)
    assert (logits[:, -1].argmax(-1) >= 300).all()  # the model itself prefers them
    out = model.generate(idx, 20, temperature=1.0, top_k=None)
    assert out.max() < 300
    assert model.generate(idx, 5, temperature=0).max() < 300


def test_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.isfinite(filter_logits(logits, top_p=1e-9)).tolist() == [[False, True, False]]
