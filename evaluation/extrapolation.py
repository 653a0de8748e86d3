"""Loss at a given context length, in the two modes that the ALiBi paper contrasts (Press et al. 2022,
section 4): `nonoverlap`, consecutive windows of L with every token scored, and `sliding` with stride S,
where only the last S tokens of each window are scored (each sees at least L - S tokens of context).
Every length scores the same `token_budget` tokens from the start of the text. Memory stays bounded at
any L: batches of about `batch_tokens` tokens, and logits formed a chunk of scored positions at a time.

Key-token perplexity (LongPPL, arXiv 2410.23771; PKU-ML/LongPPL `find_key_token`) is the perplexity over the tokens
whose log-probability in the whole window beats the one from a short context by more than ALPHA and is above BETA;
the evaluated model finds its own key tokens, where the paper uses an evaluator model (docs/probes.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from posgpt.core.threads import revisit
from posgpt.data.dataset import window_starts
from posgpt.evaluation.attention_stats import runs_at
from posgpt.model import GPT

LOGIT_ELEMENTS = 1 << 25
"""Most logits formed at once (128 MiB in float32)."""
ALPHA, BETA = 2.0, -2.0
"""LongPPL's thresholds: a key token's log-probability gain from the long context, and its least log-probability."""
CPU_SCORE_ELEMENTS = 1 << 27
"""On CPU a biased attention forms the (B, H, L, L) scores: batches keep them under 512 MiB in float32."""


@dataclass
class LengthResult:
    """One model at one context length, as results.json holds it (JSON has no NaN: a loss that is not finite,
    or not applicable, is null)."""

    length: int
    mode: str
    stride: int
    applicable: bool = True
    reason: str | None = None
    scored_tokens: int = 0
    loss: float | None = None
    by_position: list[float] = field(default_factory=list)
    """Mean loss in equal buckets of the scored positions, first to last."""
    bucket_starts: list[int] = field(default_factory=list)
    """Position in the window where each bucket of `by_position` begins."""
    ppl: float | None = None
    key_tokens: int | None = None
    """Key tokens found (LongPPL's; with a short window); `key_ppl`: the perplexity over them (None: none found)."""
    key_ppl: float | None = None


@torch.no_grad()
def evaluate_length(
    model: GPT,
    tokens: np.ndarray,
    length: int,
    stride: int | None = None,
    token_budget: int = 65536,
    buckets: int = 8,
    batch_tokens: int = 65536,
    autocast_dtype: torch.dtype | None = None,
    on_windows: Callable[[int], None] | None = None,
    short_window: int | None = None,
) -> LengthResult:
    """Loss of `model` (on its device) on `tokens` at context `length`: non-overlapping windows, or sliding
    ones with `stride`; about `batch_tokens` per pass; the model runs under autocast to `autocast_dtype`, the
    loss in float32; `on_windows` gets the windows done after each batch; with `short_window` (non-overlapping
    windows only), also key-token perplexity."""
    stride = length if stride is None else stride
    mode = "nonoverlap" if stride == length else "sliding"
    if not runs_at(model, length):
        reason = f"{model.config.pos_encoding} positions exist up to block_size={model.pe.max_positions}"
        return LengthResult(length, mode, stride, applicable=False, reason=reason)
    starts = window_starts(len(tokens), length, stride, token_budget)
    if starts.size == 0:
        raise ValueError(f"The evaluation text has {len(tokens)} tokens, too few for one window of {length} + 1.")
    batch_size = max(1, batch_tokens // length)  # and on CPU few enough for CPU_SCORE_ELEMENTS
    if model.wte.weight.device.type == "cpu":
        batch_size = min(batch_size, max(1, CPU_SCORE_ELEMENTS // (model.config.n_head * length * length)))
    model.eval()
    position_loss = torch.zeros(stride, dtype=torch.float64)  # summed over windows, scored positions only
    keyed = short_window is not None and short_window < length  # key tokens need context beyond the short window
    key_loss, key_count, i = 0.0, 0, 0
    while i < starts.size:
        rows = np.stack([tokens[s : s + length + 1] for s in starts[i : i + batch_size]]).astype(np.int64)
        try:
            losses = _window_losses(model, torch.from_numpy(rows), stride, autocast_dtype)  # (B, S)
            if keyed:
                key = _key_tokens(model, torch.from_numpy(rows), losses, short_window, autocast_dtype)
                key_loss, key_count = key_loss + losses[key].double().sum().item(), key_count + int(key.sum())
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2  # retry the same windows in smaller batches
            torch.cuda.empty_cache()
            continue
        position_loss += losses.double().sum(0).cpu()
        revisit()
        i += len(rows)
        if on_windows is not None:
            on_windows(len(rows))
    per_position = position_loss / starts.size
    chunks = per_position.tensor_split(min(buckets, stride))
    loss = per_position.mean().item()
    return LengthResult(
        length,
        mode,
        stride,
        scored_tokens=int(starts.size * stride),
        loss=loss if math.isfinite(loss) else None,
        by_position=[chunk.mean().item() for chunk in chunks],
        bucket_starts=(length - stride + np.cumsum([0] + [len(c) for c in chunks[:-1]])).tolist(),
        ppl=math.exp(loss) if math.isfinite(loss) else None,
        key_tokens=key_count if keyed else None,
        key_ppl=math.exp(key_loss / key_count) if key_count else None,
    )


def _key_tokens(model: GPT, rows: torch.Tensor, losses: torch.Tensor, short: int, autocast_dtype: torch.dtype | None
                ) -> torch.Tensor:  # fmt: skip
    """(B, L) which of the windows' predictions are of key tokens (LongPPL): the tokens from position `short` on,
    in blocks of `short` // 4, each block scored again with the `short` tokens before it as its only context;
    `rows` (B, L + 1) the windows, `losses` (B, L) their whole-window losses."""
    block = max(1, short // 4)
    key = torch.zeros_like(losses, dtype=torch.bool)
    for start in range(0, rows.size(1) - short, block):
        end = min(start + short + block, rows.size(1))  # tokens start + short .. end - 1 are scored
        brief = _window_losses(model, rows[:, start:end], end - start - short, autocast_dtype).to(losses.device)
        full = losses[:, start + short - 1 : end - 1]
        key[:, start + short - 1 : end - 1] = (brief - full > ALPHA) & (-full > BETA)
    return key


def _window_losses(model: GPT, rows: torch.Tensor, stride: int, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Cross-entropy (B, S) of the last `stride` positions of each row of `rows` (B, L + 1)."""
    device = model.wte.weight.device
    rows = rows.to(device)
    length = rows.size(1) - 1
    autocast = torch.autocast(device.type, autocast_dtype or torch.float32, enabled=autocast_dtype is not None)
    with autocast:
        hidden = model.hidden_states(rows[:, :-1])[:, length - stride :]  # (B, S, C)
    targets = rows[:, length - stride + 1 :]  # (B, S)
    chunk = max(1, LOGIT_ELEMENTS // (rows.size(0) * model.config.padded_vocab_size))
    losses = []
    for c in range(0, stride, chunk):
        with autocast:
            logits = model.lm_head(hidden[:, c : c + chunk])  # (B, chunk, V)
        losses.append(F.cross_entropy(logits.float().transpose(1, 2), targets[:, c : c + chunk], reduction="none"))
    return torch.cat(losses, dim=1)
