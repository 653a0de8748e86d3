"""BigBird-style sparse attention (Zaheer et al. 2020), causal: a window, global first tokens (the
sinks) and random earlier blocks per block of queries. The pattern by hand from BigBird's rule (R
distinct blocks outside the window and the sinks), the draws fixed by the seed at every length and
spread evenly, the older draw, the key count that log-n scaling and sigmoid attention divide by,
FlexAttention (uncompiled on the CPU) against the dense reference, the attention maps, and the refusals.
The parity matrix (test_kernels.py), the cache tests (test_cache.py: a full KV cache) and the block-mask test
(test_masks.py) take the mask with the others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import GPT, GPTConfig
from posgpt.model.masks import AttentionMask

from helpers import assert_flex_matches_eager, fidelity, uncompiled_flex

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, bias=False, pos_encoding="alibi",
                   attn_window=4, attn_sinks=1, attn_random_blocks=1, attn_sparse_block=4)  # fmt: skip


def eligible_by_hand(query_block: int, window: int, sinks: int, size: int) -> set[int]:
    """BigBird's rule (google-research/bigbird `get_single_block_row_attention`: random blocks are drawn
    from outside the window and the global blocks), token by token: key blocks holding no sink and no
    key that the block's first query sees through its window, before it."""
    first = query_block * size
    clear = [key >= sinks and not 0 <= first - key < window for key in range(first)]  # of the sinks and window
    return {j for j in range(query_block) if all(clear[j * size : (j + 1) * size])}


@pytest.mark.parametrize(("window", "sinks", "random_blocks", "size"), [(4, 1, 1, 4), (6, 3, 3, 4), (5, 0, 2, 8)])
@fidelity(
    "`attn_random_blocks: R`",
    paper="BigBird (Zaheer et al. 2020)",
    code="google-research/bigbird `get_single_block_row_attention`",
    default=(
        "off; R distinct blocks per query block from outside the window and the sinks, hashed from (seed, block, draw)"
    ),
    deviations=(
        "`attn_random_draw earlier_with_replacement` (the draw before issue 33); causal, token-level window and sinks;"
        " one draw for every head and layer, where BigBird draws per head with a seed per layer (no option)"
    ),
)
def test_each_query_block_sees_its_window_its_sinks_and_r_distinct_eligible_blocks(window, sinks, random_blocks, size):
    """R distinct blocks, all of them when fewer are eligible, none in the window or the sinks: on the
    previous draw (with replacement, among every earlier block) most draws fell in window or sink
    blocks and blocks were drawn twice."""
    mask = AttentionMask(window, sinks, random_blocks, size)
    T = 40 * size
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = mask.visible(q, k)
    drawn = 0
    for block in range(T // size):
        eligible = eligible_by_hand(block, window, sinks, size)
        picks = [p.item() for p in mask.picks(torch.tensor(block))]
        chosen = {p for p in picks if p >= 0}
        assert chosen <= eligible and len(chosen) == len([p for p in picks if p >= 0]), block  # distinct, eligible
        assert len(chosen) == min(random_blocks, len(eligible)), block
        drawn += len(chosen)
        for query in range(block * size, (block + 1) * size):
            expected = {key for key in range(query + 1) if query - key < window or key < sinks or key // size in chosen}
            assert set(visible[query].nonzero().flatten().tolist()) == expected, query
    assert drawn > 30  # the check saw many draws


def test_the_draws_are_fixed_by_the_seed_at_every_length_and_spread_over_the_eligible_blocks():
    mask = AttentionMask(window=4, sinks=1, random_blocks=2, sparse_block=4)
    blocks = torch.arange(0, 400)
    assert all(torch.equal(a[:10], b) for a, b in zip(mask.picks(blocks), mask.picks(blocks[:10]), strict=True))
    other = dataclasses.replace(mask, random_seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(other.picks(blocks), mask.picks(blocks), strict=True))
    # block 399 may draw 1..397: over the seeds, every eligible block is drawn about as often
    counts = torch.zeros(400)
    for seed in range(3000):
        for pick in dataclasses.replace(mask, random_seed=seed).picks(torch.tensor([60])):
            counts[pick] += 1
    eligible = counts[1:59]  # block 60's first query sees keys 237..240: blocks 1..58 are eligible
    assert counts[0] == 0 and counts[59:].sum() == 0 and eligible.sum() == 6000
    assert eligible.min() > 0.5 * eligible.mean() and eligible.max() < 1.6 * eligible.mean()


def test_the_draw_of_older_checkpoints_stays_available():
    """attn_random_draw='earlier_with_replacement': hash(seed, i, draw) mod i, any earlier block."""
    mask = AttentionMask(window=4, sinks=1, random_blocks=3, sparse_block=4, random_draw="earlier_with_replacement")
    picks = torch.stack(mask.picks(torch.arange(200)))  # (draws, blocks)
    assert torch.all(picks[:, 0] == -1) and torch.all(picks[:, 1:] < torch.arange(1, 200))
    assert (picks[:, 2:] >= torch.arange(2, 200) - 1).any()  # window blocks drawn too
    assert (picks[0] == picks[1]).any()  # and a block twice


@pytest.mark.parametrize(("window", "sinks", "random_blocks", "size"), [(4, 1, 1, 4), (5, 3, 3, 2), (2, 0, 4, 8)])
@pytest.mark.parametrize("draw", ["bigbird", "earlier_with_replacement"])
def test_seen_keys_counts_the_visible_keys_of_every_query(window, sinks, random_blocks, size, draw):
    """Overlaps between window, sinks and blocks, and two draws of one block, counted once: the count
    that log-n scaling and sigmoid attention's flex kernel use without forming the mask."""
    mask = AttentionMask(window, sinks, random_blocks, size, random_draw=draw)
    q = torch.arange(300)
    assert torch.equal(mask.seen_keys(q), mask.visible(q[:, None], q[None, :]).sum(-1))


def test_flex_runs_the_mask_in_its_kernel_and_matches_eager(monkeypatch):
    uncompiled_flex(monkeypatch)  # compiled flex is refused on a CPU (model/kernels/flex.py); test_gpu.py compiles it
    assert_flex_matches_eager(CONFIG, 150)  # past block_size, more than one 128-key tile


def test_the_attention_maps_show_the_pattern():
    model = GPT(CONFIG).eval()
    idx = torch.randint(0, 64, (1, 40))
    rows = []
    model.attention_weights(idx, lambda layer: (lambda r, w: rows.append(w)) if layer == 0 else None)
    weights = torch.cat(rows, dim=2)[0]  # (H, T, T)
    visible = model.kinds[0].mask.visible(torch.arange(40)[:, None], torch.arange(40)[None, :])
    assert torch.all(weights[:, ~visible] == 0) and torch.all(weights[:, visible] > 0)
    assert visible.sum() < 40 * 41 // 2 - 300  # sparse: far fewer than the causal triangle's keys


def test_decoding_keeps_every_key_and_memory_is_not_constant():
    model = GPT(CONFIG)
    assert not model.kinds[0].attention.constant_memory(model.config, model.kinds[0].mask)
    assert model.new_cache(100).parts[0].capacity == 100
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
