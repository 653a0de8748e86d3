"""Sliding-window attention and attention sinks: one mask description, every kernel, the rolling
KV cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posgpt.model import GPT, GPTConfig
from posgpt.model.kernels import Placement
from posgpt.model.kernels.block_mask import eager_block_mask
from posgpt.model.masks import AttentionMask

from helpers import fidelity, overfit, run_pair, uncompiled_flex

ODD_LEN = 13
MASKS = {
    "window": {"attn_window": 5},
    "window+sinks": {"attn_window": 5, "attn_sinks": 2},
    "bigbird": {"attn_window": 5, "attn_sinks": 1, "attn_random_blocks": 2, "attn_sparse_block": 4},
    "chunk": {"attn_chunk": 5},
}


def _config(tiny_config: GPTConfig, scheme: str, mask: str, **extra) -> GPTConfig:
    return dataclasses.replace(tiny_config, pos_encoding=scheme, **MASKS[mask], **extra)


@fidelity(
    "causal mask (`attn_window: 0`)",
    paper="Vaswani et al. 2017",
    code="none",
    default="key k visible to query q iff k ≤ q",
    deviations="none",
)
@fidelity(
    "`attn_window: W`",
    paper="Longformer (Beltagy et al. 2020), Mistral",
    code="none: one token-level predicate",
    default="off; q − k < W (W keys, the query's own included)",
    deviations="none",
)
@fidelity(
    "`attn_sinks: S`",
    paper="Xiao et al. 2024 (StreamingLLM)",
    code="mit-han-lab/streaming-llm `StartRecentKVCache`",
    default="off; the first S keys visible to every query, a rolling S + W cache",
    deviations=(
        "a training mask here, not only a decoding cache; cached keys keep their absolute positions, where "
        "StreamingLLM's `pos_shift` re-numbers positions within the cache (no option)"
    ),
)
def test_the_mask_predicates_by_hand():
    mask = AttentionMask(window=3, sinks=1)
    q, k = torch.arange(6)[:, None], torch.arange(6)[None, :]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # key 0 is a sink; keys 1..3 the window
        [1, 0, 1, 1, 1, 0],
        [1, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)  # fmt: skip
    assert torch.equal(mask.visible(q, k), expected)
    assert torch.equal(AttentionMask().visible(q, k), torch.ones(6, 6, dtype=torch.bool).tril())


@pytest.mark.parametrize("q_len", [300, 293])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_the_flex_block_mask_is_the_dense_mask(mask, q_len):
    """Element by element the block mask's mask_mod is the dense mask, and no block holding a visible
    key is skipped (block sparsity never drops a key); 300 keys span several 128-key blocks."""
    description = AttentionMask(**{k.removeprefix("attn_"): v for k, v in MASKS[mask].items()})
    wide = {"window": 100} if description.window else {"chunk": 100}  # wider than a block
    description = dataclasses.replace(description, **wide)
    block_mask = eager_block_mask(description, Placement(q_len, 1, torch.device("cpu")), {})
    q_idx, kv_idx = torch.arange(q_len)[:, None], torch.arange(q_len)[None, :]
    dense = description.dense(torch.arange(q_len), torch.arange(q_len))
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(block_mask.mask_mod(zero, zero, q_idx, kv_idx), dense)
    blocks = block_mask.to_dense()[0, 0].bool()  # (query blocks, key blocks) that are computed
    q_block, kv_block = block_mask.BLOCK_SIZE
    needed = dense.reshape(-1, 1).new_zeros(blocks.shape)
    for i, j in dense.nonzero().tolist():
        needed[i // q_block, j // kv_block] = True
    assert torch.equal(blocks | needed, blocks) and blocks.sum() < blocks.numel()  # covers them; sparse


def test_flex_with_a_window_and_sinks_matches_eager(monkeypatch, tiny_config):
    """FlexAttention's block mask and a learned score_mod (T5) from the same description, logits at both
    lengths (uncompiled on the CPU, where compiled flex is refused: one scheme here, the block masks of
    every mask above, every scheme, mask and score in test_kernels.py; compiled and gradients on a GPU)."""
    uncompiled_flex(monkeypatch)
    config = _config(tiny_config, "t5", "window+sinks")
    for T, (ref, _), (logits, _) in run_pair(config, "t5", "flex", torch.device("cpu"), torch.float32, ODD_LEN):
        torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-4, msg=f"logits, T={T}")


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("scheme", ["learned", "rope", "alibi"])
@fidelity("`attn_window: W`")
def test_a_key_outside_the_window_has_no_influence_and_one_inside_does(tiny_config, scheme, backend):
    """One layer: the last token's logits depend on the tokens in its window and the sinks only."""
    config = _config(tiny_config, scheme, "window+sinks", n_layer=1, attn_backend=backend)  # W = 5, S = 2
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (1, 14))
    last = idx.size(1) - 1
    with torch.no_grad():
        base = model(idx)[0][0, -1]
        for position, inside in ((last - 5, False), (2, False), (last - 4, True), (1, True)):
            changed = idx.clone()
            changed[0, position] = (changed[0, position] + 1) % config.vocab_size
            diff = (model(changed)[0][0, -1] - base).abs().max()
            assert (diff > 1e-4) == inside, (position, inside, diff)


@pytest.mark.parametrize("scheme", ["sinusoidal", "alibi"])
def test_a_window_as_long_as_the_sequence_is_full_causal_attention(tiny_config, scheme):
    full = GPT(dataclasses.replace(tiny_config, pos_encoding=scheme, attn_backend="eager")).eval()
    windowed = GPT(dataclasses.replace(full.config, attn_window=ODD_LEN)).eval()
    windowed.load_state_dict(full.state_dict())
    idx = torch.randint(0, tiny_config.vocab_size, (2, ODD_LEN))
    with torch.no_grad():
        assert torch.equal(windowed(idx)[0], full(idx)[0])


def test_a_window_model_overfits_a_batch(tiny_config):
    _, final = overfit(GPT(_config(tiny_config, "rope", "window+sinks")), steps=60, lr=1e-2)
    assert final < 0.2


def test_flops_count_the_keys_a_window_sees(tiny_config):
    full = GPT(tiny_config)
    windowed = GPT(dataclasses.replace(tiny_config, attn_window=4, attn_sinks=1))
    c = tiny_config
    per_key = 12 * c.n_layer * c.n_head * c.head_dim
    assert full.flops_per_token(64) - windowed.flops_per_token(64) == per_key * (64 - 5)


@pytest.mark.parametrize("limit", [1 << 24, 1 << 14])
@pytest.mark.parametrize("length", [300, 293, 556, 1])
@pytest.mark.parametrize("mask", [AttentionMask(), AttentionMask(100), AttentionMask(200, 3), AttentionMask(130, 140)])
def test_the_block_mask_built_in_chunks_is_create_block_masks(monkeypatch, mask, length, limit):
    """Tile by tile (partial and full tiles, their order) what `create_block_mask` builds from the
    whole dense mask, whether the visibility is formed at once or a few query tiles at a time."""
    from torch.nn.attention.flex_attention import create_block_mask

    from posgpt.model.kernels import block_mask

    monkeypatch.setattr(block_mask, "DENSE_ELEMENTS", limit)
    expected = create_block_mask(lambda b, h, q, k: mask.visible(q, k), None, None, length, length, device="cpu")
    built = block_mask.block_mask_in_chunks(mask, length, torch.device("cpu"))
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(built, name), getattr(expected, name)), name
    assert torch.equal(built.to_dense(), expected.to_dense()) and built.seq_lengths == (length, length)


def test_a_compiled_model_builds_its_block_mask_eagerly(monkeypatch, tiny_config):
    """Inside a compiled forward the block mask is built outside the graph (no sort traced into it,
    no guard on the memo): the compiled logits are the eager ones (dynamo's eager backend, flex
    unfused on the CPU). The module that builds it is imported inside the first, compiled, forward."""
    import dataclasses
    import sys

    from posgpt.model import GPT

    uncompiled_flex(monkeypatch)
    monkeypatch.delitem(sys.modules, "posgpt.model.kernels.block_mask", raising=False)
    config = dataclasses.replace(tiny_config, pos_encoding="alibi", attn_backend="flex", attn_window=6, n_layer=1)
    model = GPT(config).eval()
    idx = torch.randint(0, tiny_config.vocab_size, (2, 40))
    with torch.no_grad():
        compiled, _ = torch.compile(model, backend="eager")(idx)
        assert "posgpt.model.kernels.block_mask" in sys.modules
        torch._dynamo.reset()
        expected, _ = model(idx)
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)
