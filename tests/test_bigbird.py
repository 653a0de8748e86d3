"""BigBird-style sparse attention (Zaheer et al. 2020), causal: a window, global first tokens (the
sinks) and random earlier blocks per block of queries. The pattern by hand, the draws fixed by the
seed at every length, the key count that log-n scaling and sigmoid attention divide by, compiled
FlexAttention against the dense reference, the attention maps, and the refusals. The parity matrix
(test_kernels.py), the cache tests (test_cache.py: a full KV cache) and the block-mask test
(test_masks.py) take the mask with the others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.errors import ConfigError
from model import GPT, GPTConfig
from model.masks import AttentionMask

from helpers import assert_flex_matches_eager

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, bias=False, pos_encoding="alibi",
                   attn_window=4, attn_sinks=1, attn_random_blocks=1, attn_sparse_block=4)  # fmt: skip


def test_each_query_block_sees_its_window_its_sinks_and_its_random_blocks_by_hand():
    mask = AttentionMask.of(CONFIG)
    q, k = torch.arange(48)[:, None], torch.arange(48)[None, :]
    visible = mask.visible(q, k)
    for query in range(48):
        block = query // 4
        picked = mask.pick(torch.tensor(block), 0).item()
        assert (picked == -1) == (block == 0) and picked < block  # an earlier block, none for the first
        expected = {key for key in range(query + 1) if query - key < 4 or key < 1 or key // 4 == picked}
        assert set(visible[query].nonzero().flatten().tolist()) == expected, query
    # a fixed seed: the same blocks at every length; another seed, other blocks
    blocks = torch.arange(1, 200)
    assert torch.equal(mask.pick(blocks, 0)[:10], mask.pick(blocks[:10], 0))
    other = dataclasses.replace(mask, random_seed=1)
    assert not torch.equal(other.pick(blocks, 0), mask.pick(blocks, 0))


@pytest.mark.parametrize(("window", "sinks", "random_blocks", "size"), [(4, 1, 1, 4), (5, 3, 3, 2), (2, 0, 4, 8)])
def test_seen_keys_counts_the_visible_keys_of_every_query(window, sinks, random_blocks, size):
    """Overlaps between window, sinks and blocks, and two draws of one block, counted once: the count
    that log-n scaling and sigmoid attention's flex kernel use without forming the mask."""
    mask = AttentionMask(window, sinks, random_blocks, size)
    q = torch.arange(300)
    assert torch.equal(mask.seen_keys(q), mask.visible(q[:, None], q[None, :]).sum(-1))


def test_compiled_flex_runs_the_mask_in_its_kernel_and_matches_eager():
    # a fresh compile: after other tests' shapes dynamo compiles flex for dynamic shapes, where torch
    # 2.13's CPU flex template fails to build this mask's C++ (an inductor bug; CPU flex is never auto)
    torch._dynamo.reset()
    assert_flex_matches_eager(CONFIG, 150)  # past block_size, more than one 128-key tile


def test_the_attention_maps_show_the_pattern():
    model = GPT(CONFIG).eval()
    idx = torch.randint(0, 64, (1, 40))
    rows = []
    model.attention_weights(idx, lambda layer: (lambda r, w: rows.append(w)) if layer == 0 else None)
    weights = torch.cat(rows, dim=2)[0]  # (H, T, T)
    visible = model.mask.visible(torch.arange(40)[:, None], torch.arange(40)[None, :])
    assert torch.all(weights[:, ~visible] == 0) and torch.all(weights[:, visible] > 0)
    assert visible.sum() < 40 * 41 // 2 - 300  # sparse: far fewer than the causal triangle's keys


def test_decoding_keeps_every_key_and_memory_is_not_constant():
    model = GPT(CONFIG)
    assert not model.attention.constant_memory(model.mask)
    assert model.new_cache(100).capacity == 100
    assert model.flops_per_token(32) < GPT(dataclasses.replace(CONFIG, attn_random_blocks=0, attn_window=0,
                                                               attn_sinks=0)).flops_per_token(32)  # fmt: skip


def test_bad_settings_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="must be a positive divisor of block_size 32, got 5"):
        dataclasses.replace(CONFIG, attn_sparse_block=5)
    with pytest.raises(ConfigError, match="set attn_window > 0"):
        dataclasses.replace(CONFIG, attn_window=0, attn_sinks=0)
    with pytest.raises(ConfigError, match="attn_random_blocks must be an integer >= 0"):
        dataclasses.replace(CONFIG, attn_random_blocks=-1)
    again = GPTConfig.from_dict(dataclasses.replace(CONFIG, attn_random_seed=7).to_dict())
    assert AttentionMask.of(again).random_seed == 7  # the draws travel with the checkpoint's config
