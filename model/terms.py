"""What may be done to the attention scores beyond score(q, k): the kinds (`Term`), and what carries each to
the kernels. A kernel declares the kinds it runs (`Kernel.terms`); a position scheme (`PositionEncoding.terms`),
an attention function (`Attention.terms`) and the mask ask for theirs, and `auto` and the refusals read both
(`Needs.unmet`), never a name.

The kinds apply in this order to s = score(q, k), the score of query i on key j (positions i, j):

1. `TRANSFORM`: s -> g(s), a pointwise function of the score alone (Gemma 2's soft-cap c tanh(s / c)), carried by
   the layer's plan (`Plan.transform`): before every other term, so that none is transformed (ALiBi's
   -m (i - j) would saturate at -c under a cap);
2. `POSITIONS`: + f_h(i - j, i), a formula of positions (ALiBi, T5, Kerple, FIRE), carried by
   `ScoreBias.formula` in the forward pass's context;
3. `TOKENS`: + c_q[b, h, i] - c_k[b, h, j], values of the layer's own tokens (FoX's forget-gate sums), carried
   by the layer's plan (`TokenTerms`, `Plan.tokens`);
4. `MASK`: -inf where the mask hides key j, beyond causal (a window, sinks, random blocks: `AttentionMask`);
5. `FROM_SCORES`: + t(q, s, visible), a term computed from the masked scores themselves (CoPE), carried by
   `ScoreBias.from_scores`;

then the attention function turns the result into weights (softmax, sigmoid, stick-breaking, ...), and last

6. `MASS`: a softmax's normaliser takes one more term per head, exp(z_h), a logit with no key and no value
   (gpt-oss's sinks), carried by the layer's plan (`Plan.sinks`): the weights sum to less than 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from torch import Tensor


class Term(Enum):
    """A kind of modification of the scores (the module docstring gives their order): the need in words, as a
    refusal says it, and the model setting that asks for it."""

    TRANSFORM = ("a transform of the scores (a soft-cap)", "attn_softcap")
    POSITIONS = ("a position score bias", "pos_encoding")
    TOKENS = ("terms of the layer's tokens added to the scores", "attention")
    MASK = ("a mask beyond causal (attn_window, attn_sinks, attn_chunk)", "attn_window")
    FROM_SCORES = ("positions computed from the scores", "pos_encoding")
    MASS = ("softmax mass with no key (sink logits)", "attn_sink_logits")


TERMS = tuple(Term)
"""Every kind in order: a tuple, as torch 2.11's dynamo cannot iterate an Enum class (the kernel choice is traced)."""


ScoresTerm = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(queries (B, H, rows, D), their scores (B, H, rows, Tk) with -inf where a key is not visible, the visibility)
-> a term (B, H, rows, Tk) added to the scores (`Term.FROM_SCORES`)."""


@dataclass(frozen=True)
class ScoreBias:
    """One layer's position terms for one forward pass: `formula(h, distance, query)` (`Term.POSITIONS`), the
    float32 bias of head(s) `h` for a key `distance` = i - j before a query at position i (broadcasting tensors),
    called on index grids by eager and SDPA and inside FlexAttention's score_mod; or `from_scores`
    (`Term.FROM_SCORES`).

    The formula reads tensors computed beforehand, each on its own and through one index by head:
    compiled FlexAttention refuses a gradient tensor read twice or transformed inside a score_mod
    (`validate_joint_graph`, torch 2.11 to 2.13), and gives a view of a parameter no gradient (`separate`)."""

    formula: Callable[[Tensor, Tensor, Tensor], Tensor] | None
    elements: int
    """Float32 values the formula forms per query-key pair for all heads: sizes a dense kernel's row blocks."""
    kernel_options: dict[str, int] | None = None
    """FlexAttention's tile options on CUDA, for a formula that does not fit the default tiles' shared memory."""
    from_scores: ScoresTerm | None = None
    """A term computed from the scores themselves, added where they are formed."""
    relative: bool = False
    """The formula reads the distance alone (the scheme's `relative`: ALiBi, T5, Kerple), set by `GPT._hidden`."""
    learned: bool = False
    """It reads parameters, which a pass with gradients carries back (the scheme's `learned_bias`), set likewise."""


class TokenTerms(NamedTuple):
    """`Term.TOKENS` of one layer and batch: c_q[b, h, i] - c_k[b, h, j] is added to the scores. Two tensors
    even where they hold the same values: compiled flex refuses a gradient tensor read twice in a score_mod."""

    q: Tensor
    """(B, H, Tq), float32."""
    k: Tensor
    """(B, H, Tk), float32."""
