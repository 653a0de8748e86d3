"""Scoring functions: how a query and a key make an attention score before the softmax.

| `attn_score` | score(q, k)                               | parameters per head | per query-key pair   |
|--------------|-------------------------------------------|---------------------|----------------------|
| `scaled_dot` | q . k / sqrt(D) (Vaswani et al. 2017)     | none                | D multiply-adds      |
| `dot`        | q . k (Luong et al. 2015)                 | none                | D multiply-adds      |
| `general`    | q . W k (Luong et al. 2015)               | D^2                 | D multiply-adds      |
| `additive`   | v . tanh(W_q q + W_k k) (Bahdanau et al.) | 2 D^2 + D           | D tanh + D mult-adds |

The general score is (q W) . k: the layer hands the fused kernels q W (`Score.queries`, before the
scheme's rotation, so that with RoPE it still depends on relative positions only). The additive score
forms a (Tq, Tk, D) tensor: only the eager kernel runs it, in chunks of queries.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig

ADDITIVE_CHUNK_ELEMENTS = 1 << 24
"""Largest (B, H, chunk, Tk, D) tensor the additive score forms at once (64 MiB in float32)."""


class Score(nn.Module):
    """A scoring function, built from the head count and size (`SCORES`); `scale`: a dot-product score's factor."""

    dot_product: bool = True
    """Whether the score is q . k times `scale` (what SDPA and FlexAttention compute)."""
    standard: bool = False
    """Whether it is q . k / sqrt(D), the one score a function that scores no pairs (linear) accepts."""
    scale: float | None = None

    @classmethod
    def build(cls, config: GPTConfig) -> Score:
        """The score for a model of `config` (its head count and size)."""
        return cls()

    def queries(self, q: Tensor) -> Tensor:
        """The queries (B, H, Tq, D) that the kernels score against the keys, before the scheme rotates them."""
        return q

    def scoring(self, dims: int) -> Score:
        """This score for queries and keys of `dims` dimensions (differential attention's halves)."""
        return self

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        """Scores (B, H, Tq, Tk) of queries (B, H, Tq, D), as `queries` returned them, on keys (B, H, Tk, D)."""
        return (q @ k.transpose(-2, -1)) * self.scale

    def query_chunk(self, q: Tensor, k: Tensor) -> int:
        """Queries to score at once so that memory stays bounded."""
        return q.size(-2)


class ScaledDot(Score):
    standard = True

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)

    @classmethod
    def build(cls, config: GPTConfig) -> Score:
        return cls(config.head_dim)

    def scoring(self, dims: int) -> Score:
        return ScaledDot(dims)


class Dot(Score):
    scale = 1.0


def per_head(x: Tensor, w: Tensor) -> Tensor:
    """x (B, H, T, D) times each head's own matrix w (H, D, E) -> (B, H, T, E), in x's dtype."""
    return torch.einsum("bhtd,hde->bhte", x, w.to(x.dtype))


class HeadParameters(Score):
    """A score with parameters of its own per head, built from the head count and size."""

    @classmethod
    def build(cls, config: GPTConfig) -> Score:
        return cls(config.n_head, config.head_dim)


class General(HeadParameters):
    """Luong's general (bilinear) score, per head h: q . W_h k, as the dot product (q W_h) . k."""

    scale = 1.0

    def __init__(self, n_head: int, head_dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n_head, head_dim, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d = self.w.size(-1)
        with torch.no_grad():  # the scaled dot product to start with
            self.w.copy_(torch.eye(d).expand_as(self.w) / math.sqrt(d))

    def queries(self, q: Tensor) -> Tensor:
        return per_head(q, self.w)


class Additive(HeadParameters):
    """Bahdanau's additive (concat) score, per head h: v_h . tanh(W_q,h q + W_k,h k)."""

    dot_product = False

    def __init__(self, n_head: int, head_dim: int) -> None:
        super().__init__()
        self.w_q = nn.Parameter(torch.empty(n_head, head_dim, head_dim))
        self.w_k = nn.Parameter(torch.empty(n_head, head_dim, head_dim))
        self.v = nn.Parameter(torch.empty(n_head, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d = self.v.size(-1)
        for p in (self.w_q, self.w_k, self.v):  # W q keeps q's scale: the tanh starts unsaturated
            nn.init.normal_(p, std=d**-0.5)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        wq, wk = per_head(q, self.w_q), per_head(k, self.w_k)  # (B, H, Tq, D), (B, H, Tk, D)
        hidden = torch.tanh(wq[:, :, :, None, :] + wk[:, :, None, :, :])  # (B, H, Tq, Tk, D)
        return torch.einsum("bhqkd,hd->bhqk", hidden, self.v.to(q.dtype))

    def query_chunk(self, q: Tensor, k: Tensor) -> int:
        B, H, _, D = q.shape
        return max(1, ADDITIVE_CHUNK_ELEMENTS // (B * H * k.size(-2) * D))


class LogLengthScale(nn.Module):
    """Log-length attention scaling (SSMax, Nakanishi 2025): each query times s_h ln(n), n the keys it sees,
    so that a query can still single out one key at any length (the softmax's largest weight falls as 1/n)."""

    def __init__(self, n_head: int, s: float, learned: bool) -> None:
        super().__init__()
        start = torch.full((n_head,), float(s))
        if learned:
            self.s = nn.Parameter(start)
        else:
            self.register_buffer("s", start, persistent=False)

    @classmethod
    def of(cls, config: GPTConfig) -> LogLengthScale | None:
        if config.attn_log_scaling == "none":
            return None
        s = config.attn_log_scale if config.attn_log_scale is not None else 1.0 / math.log(config.block_size)
        return cls(config.n_head, s, learned=config.attn_log_scaling == "learned")

    def forward(self, q: Tensor, seen: Tensor) -> Tensor:
        """Queries (B, H, T, D) scaled by s_h ln(seen), `seen` (T,) or (B, T) key counts."""
        log_n = torch.log(seen.float()).unsqueeze(-2)[..., None]  # (B?, 1, T, 1)
        return (q.float() * (self.s.float()[None, :, None, None] * log_n)).to(q.dtype)


SCORES: dict[str, type[Score]] = {"scaled_dot": ScaledDot, "dot": Dot, "general": General, "additive": Additive}
"""The scoring functions by `attn_score` name (`Score.build` makes one for a model)."""
