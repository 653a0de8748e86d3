"""Loss at a given context length, in the two modes that the ALiBi paper contrasts.

- `nonoverlap`: the text cut into consecutive windows of L tokens; every token is scored, so a
  token at position i of its window sees i tokens of context (Press et al. 2022, section 4).
- `sliding` with stride S: windows of L advancing by S; only the last S tokens of each window are
  scored, so every scored token sees at least L - S tokens of context. S = L is `nonoverlap`.

Every length scores the same number of tokens (`token_budget`), taken from the start of the text,
so lengths are compared on equal footing. Loss is also reported by position inside the window,
in equal buckets, which shows where a scheme breaks down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from data.dataset import window_starts
from model import GPT


@dataclass
class LengthResult:
    """One model at one context length."""

    length: int
    mode: str
    stride: int
    applicable: bool = True
    reason: str | None = None
    """Why the model cannot run at this length (when not applicable)."""
    scored_tokens: int = 0
    loss: float = math.nan
    by_position: list[float] = field(default_factory=list)
    """Mean loss in `len(by_position)` equal buckets of the scored positions, first to last."""

    @property
    def ppl(self) -> float:
        return math.exp(self.loss) if self.applicable else math.nan


@torch.no_grad()
def evaluate_length(
    model: GPT,
    tokens: np.ndarray,
    length: int,
    stride: int | None = None,
    token_budget: int = 65536,
    batch_size: int = 8,
    buckets: int = 8,
) -> LengthResult:
    """Loss of `model` on `tokens` at context `length` (see the module docstring).

    Args:
        model: the GPT, on the device to run on.
        tokens: the evaluation text as token ids.
        length: context length L.
        stride: S for sliding windows; None (or L) means non-overlapping windows.
        token_budget: tokens to score (fewer if the text runs out).
        batch_size: windows per forward pass.
        buckets: number of position buckets in `by_position`.
    """
    stride = length if stride is None else stride
    mode = "nonoverlap" if stride == length else "sliding"
    if not 0 < stride <= length:
        raise ValueError(f"stride must be in 1..{length} (the length), got {stride}.")
    limit = model.pe.max_positions
    if limit is not None and length > limit:
        reason = f"{model.config.pos_encoding} positions exist up to block_size={limit}"
        return LengthResult(length, mode, stride, applicable=False, reason=reason)
    starts = window_starts(len(tokens), length, stride, token_budget)
    if starts.size == 0:
        raise ValueError(f"The evaluation text has {len(tokens)} tokens, too few for one window of {length} + 1.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    position_loss = torch.zeros(stride, dtype=torch.float64)  # summed over windows, scored positions only
    for i in range(0, starts.size, batch_size):
        rows = np.stack([tokens[s : s + length + 1] for s in starts[i : i + batch_size]]).astype(np.int64)
        batch = torch.from_numpy(rows).to(device)
        logits, _ = model(batch[:, :-1])
        scored = logits[:, length - stride :].float()  # (B, S, V): the last S positions
        targets = batch[:, length - stride + 1 :]
        losses = torch.nn.functional.cross_entropy(scored.transpose(1, 2), targets, reduction="none")  # (B, S)
        position_loss += losses.double().sum(0).cpu()
    model.train(was_training)
    per_position = position_loss / starts.size
    bucketed = [chunk.mean().item() for chunk in per_position.tensor_split(min(buckets, stride))]
    return LengthResult(
        length,
        mode,
        stride,
        scored_tokens=int(starts.size * stride),
        loss=per_position.mean().item(),
        by_position=bucketed,
    )
