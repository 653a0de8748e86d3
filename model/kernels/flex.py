"""The flex kernel: FlexAttention, the mask as a block mask (unseen tiles skipped) and the scheme's bias
as a score_mod, fused in one compiled kernel. `auto` picks it on CUDA for a bias or a window, not for
decoding (its mask changes every step).

CUDA only, because compiled FlexAttention returns wrong numbers on a CPU in torch 2.13 (plain torch:
`torch.compile(flex_attention)` with a causal `create_block_mask`, against SDPA, lengths 1-300):
- forward: wrong when the number of keys is 8 mod 16 (0.03 off in the logits of a 2-layer model at 24
  tokens, whole rows off by 1-3 in a bare call, NaN at times), not deterministically (right in one
  process, wrong in the next); seen with head sizes 8 and 16, not in the same sweeps with 32 and 64;
  13, 17, 100, 127, 129, 136 and 200 tokens are exact;
- decoding (one or five queries over the cache's keys): the same, at 8 keys;
- backward: none on a CPU, compiled or not (NotImplementedError).
Uncompiled flex is exact on a CPU: the tests run this kernel's block masks and score_mods through it
(`tests/helpers.py` `uncompiled_flex`); `posgpt check` runs the compiled kernel on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from posgpt.model.kernels.base import Kernel, Needs, Step, WeightsHook
from posgpt.model.masks import AttentionMask
from posgpt.model.positions import ScoreBias
from posgpt.model.scores import Score

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@functools.cache
def compiled_flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled once per process, at first use (uncompiled it forms the whole score matrix)."""
    return torch.compile(flex_attention)


def score_mod_of(bias: ScoreBias, step: Step) -> ScoreMod:
    """The scheme's bias as a FlexAttention score_mod: the same formula as the dense path's."""
    positions = step.positions
    if positions is not None:  # each row at its own positions: its keys' in the cache, or its own
        keys = step.k_pos if step.k_pos is not None else positions

        def score_mod_rows(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            query = positions[b, q_idx]
            return score + bias(h, query - keys[b, kv_idx], query)

        return score_mod_rows

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + bias(h, q_idx - kv_idx, q_idx)

    return score_mod


def build_block_mask(mask: AttentionMask, step: Step, cache: dict | None) -> BlockMask:
    """The block mask of `mask` for a forward pass (block_mask.py, imported here: it imports Dynamo, 2 s)."""
    from posgpt.model.kernels.block_mask import eager_block_mask

    return eager_block_mask(mask, step, cache)


@dataclass(frozen=True)
class FlexContext:
    block_mask: BlockMask
    score_mod: ScoreMod | None
    kernel_options: dict[str, int] | None = None

    def decayed(self, c_q: Tensor, c_k: Tensor) -> FlexContext:
        """This context with c_q[b, h, i] - c_k[b, h, j] added to the scores in the score_mod (FoX's gate sums)."""
        inner = self.score_mod

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            scored = inner(score, b, h, q_idx, kv_idx) if inner is not None else score
            return scored + c_q[b, h, q_idx] - c_k[b, h, kv_idx]

        return dataclasses.replace(self, score_mod=score_mod)


class FlexKernel(Kernel):
    """Fused with a block-sparse mask and an in-kernel bias; no dropout; CUDA only (module docstring)."""

    score_bias = True
    bias_gradients = True
    devices = frozenset({"cuda"})
    device_notes = {"cpu": "compiled FlexAttention returns wrong numbers on a CPU in torch 2.13"}
    backward_devices = frozenset({"cuda"})
    min_head_size = {"cuda": 16}  # torch 2.11's Triton kernel: "embedding dimension ... must be at least 16"
    no_float64_on = {"cuda": "Triton's FlexAttention template has no float64 matmul"}  # H200, torch 2.11
    auto_devices = frozenset({"cuda"})
    sparse_masks = True

    def rank(self, needs: Needs, device: torch.device) -> float:
        # first for a bias or a window on CUDA when the lengths repeat; after SDPA otherwise
        return 0.0 if (needs.score_bias or needs.sparse_mask) and not needs.decoding else 1.5

    def context(
        self, bias: ScoreBias | None, mask: AttentionMask, step: Step, memo: dict, **settings: Any
    ) -> FlexContext:
        options = bias.kernel_options if bias is not None else None
        return FlexContext(build_block_mask(mask, step, memo), self.score_mod(bias, mask, step, **settings), options)

    def score_mod(self, bias: ScoreBias | None, mask: AttentionMask, step: Step) -> ScoreMod | None:
        """What the kernel makes of the scores: the scheme's bias added (None: nothing)."""
        return score_mod_of(bias, step) if bias is not None else None

    def run(
        self, q: Tensor, k: Tensor, v: Tensor, context: FlexContext, score: Score, dropout_p: float,
        on_weights: WeightsHook | None,
    ) -> Tensor:  # fmt: skip
        return compiled_flex_attention()(q, k, v, score_mod=context.score_mod, block_mask=context.block_mask,
                                         scale=score.scale, kernel_options=context.kernel_options)  # fmt: skip
