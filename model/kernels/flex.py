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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from posgpt.model.kernels.base import Kernel, Needs, Placement, Plan
from posgpt.model.masks import AttentionMask
from posgpt.model.scores import Score
from posgpt.model.terms import ScoreBias, Term

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@functools.cache
def compiled_flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled once per process, at first use (uncompiled it forms the whole score matrix)."""
    return torch.compile(flex_attention)


def score_mod_of(bias: ScoreBias, placement: Placement) -> ScoreMod:
    """The scheme's bias as a FlexAttention score_mod: the same formula as the dense path's."""
    positions, formula = placement.positions, bias.formula  # not the frozen dataclass: dynamo 2.11 cannot call it
    keys = placement.k_pos if placement.k_pos is not None else positions
    assert formula is not None

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if positions is None:
            return score + formula(h, q_idx - kv_idx, q_idx)
        query = positions[b, q_idx]  # each row at its own positions: its keys' in the cache, or its own
        return score + formula(h, query - keys[b, kv_idx], query)

    return score_mod


@dataclass(frozen=True)
class FlexContext:
    """The block mask, the position terms (`positions`) and the function's weights of the scores (`weights`, as a
    log: None for softmax) as score_mods."""

    block_mask: BlockMask
    positions: ScoreMod | None
    weights: ScoreMod | None = None
    kernel_options: dict[str, int] | None = None

    def score_mod(self, plan: Plan) -> ScoreMod | None:
        """The score_mod of a layer's `plan`: its transform, the position terms, its token terms, then the function's
        weights (`model.terms`' order; the mask is the block mask's)."""
        positions, tokens, transform, weights = self.positions, plan.tokens, plan.transform, self.weights
        if tokens is None and transform is None and weights is None:
            return positions

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            if transform is not None:
                score = transform(score)
            if positions is not None:
                score = positions(score, b, h, q_idx, kv_idx)
            if tokens is not None:
                score = score + tokens.q[b, h, q_idx] - tokens.k[b, h, kv_idx]
            return weights(score, b, h, q_idx, kv_idx) if weights is not None else score

        return score_mod


class FlexKernel(Kernel):
    """`torch.nn.attention.flex_attention`, compiled once per process at first use, with the block mask of the
    attention mask and a position bias as a `score_mod` (no T×T bias in memory); no attention dropout. CUDA only: a
    CPU refuses it at the forward pass, since compiled FlexAttention returns wrong numbers there in torch 2.13 (the
    module docstring says where); the tests run it on a CPU through its uncompiled path, which is exact."""

    terms = frozenset(Term) - {Term.FROM_SCORES}
    term_gradients = True
    grouped_kv = True
    devices = frozenset({"cuda"})
    device_notes = {"cpu": "compiled FlexAttention returns wrong numbers on a CPU in torch 2.13"}
    backward_devices = frozenset({"cuda"})
    min_head_size = {"cuda": 16}  # torch 2.11's Triton kernel: "embedding dimension ... must be at least 16"
    no_float64_on = {"cuda": "Triton's FlexAttention template has no float64 matmul"}  # H200, torch 2.11
    auto_devices = frozenset({"cuda"})

    def rank(self, needs: Needs, device: torch.device) -> float:
        # first for a bias or a window on CUDA when the lengths repeat; after SDPA otherwise, and where a learned table
        # needs gradients: flex's backward adds every (query, key) pair's into its few entries with atomics (T5 at
        # 0.02 of RoPE on an H100, BENCHMARKS.md), where SDPA takes the table's gradient back through its dense bias
        return 0.0 if needs.terms and not needs.decoding and not needs.table_gradients else 1.5

    def context(
        self, bias: ScoreBias | None, mask: AttentionMask, placement: Placement, memo: dict, **settings: Any
    ) -> FlexContext:
        from posgpt.model.kernels.block_mask import eager_block_mask  # here: it imports Dynamo (2 s)

        options = bias.kernel_options if bias is not None else None
        positions = score_mod_of(bias, placement) if bias is not None else None
        weights = self.weights_mod(mask, placement, **settings)
        return FlexContext(eager_block_mask(mask, placement, memo), positions, weights, options)

    def weights_mod(self, mask: AttentionMask, placement: Placement, **settings: Any) -> ScoreMod | None:
        """The attention function's weights of the scores as a score_mod, their log (None: the softmax's own)."""
        return None

    def flex(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, aux: AuxRequest | None = None) -> Any:
        """Compiled FlexAttention of the plan's context: the output, and with `aux` the output and what it asks."""
        context: FlexContext = plan.context
        return compiled_flex_attention()(q, k, v, score_mod=context.score_mod(plan), block_mask=context.block_mask,
                                         scale=score.scale, kernel_options=context.kernel_options,
                                         return_aux=aux, enable_gqa=k.size(1) != q.size(1))  # fmt: skip

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        if plan.sinks is None:
            return self.flex(q, k, v, plan, score)
        out, aux = self.flex(q, k, v, plan, score, AuxRequest(lse=True))
        # a keyless logit z_h in the normaliser Z: each weight times Z / (Z + e^z) = sigmoid(ln Z - z)
        wide = torch.promote_types(q.dtype, torch.float32)
        share = torch.sigmoid(aux.lse.to(wide) - plan.sinks.to(wide)[:, None])
        return (out.to(wide) * share[..., None]).to(q.dtype)
