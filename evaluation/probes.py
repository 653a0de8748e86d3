"""The retrieval probes (`data.probes`) scored on a checkpoint: each cell (probe, length, depth) a batch of seeded
prompts, answered greedily through the sampler's padded prefill and KV cache, each answer scored as its reference
scores it; a cell that cannot run is n/a with the reason, as perplexity is past a learned table."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from posgpt.core.threads import revisit
from posgpt.data.errors import DataError
from posgpt.data.probes import PROBES, trials
from posgpt.data.tokenizer import Tokenizer
from posgpt.evaluation.attention_stats import runs_at
from posgpt.model.generation import pad_prompts, stream
from posgpt.model.gpt import GPT

SEED = 0
"""The probes' prompts: the same for every model and seed, so that cells compare."""


@torch.no_grad()
def greedy_answers(model: GPT, prompts: list[list[int]], new_tokens: int, window: int) -> list[list[int]]:
    """`new_tokens` greedy tokens after each prompt, all in one batch (padded on the right, cached), the model
    seeing up to `window` tokens."""
    idx, lengths = pad_prompts(prompts, model.wte.weight.device)
    steps = stream(model, idx, new_tokens, temperature=0.0, max_context=window, lengths=lengths)
    return torch.cat(list(steps), dim=1).tolist()


def probe_rows(
    model: GPT,
    tokenizer: Tokenizer,
    names: list[str],
    lengths: list[int],
    depths: list[float | None],
    count: int,
    haystack: str = "",
    on_cell: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """A row per probe, length and depth (None: the reference's uniform draw): the mean score of `count` trials
    (0 to 1; RULER's `string_match_all` gives partial credit), or n/a with the reason."""
    model.eval()
    rows = []
    for name, length, depth in itertools.product(names, lengths, depths):
        probe = PROBES[name]
        row: dict[str, Any] = {"probe": name, "length": length, "depth": depth, "trials": count, "score": None,
                               "applicable": False, "reason": None}  # fmt: skip
        if not runs_at(model, length):
            row["reason"] = f"{model.config.pos_encoding} positions exist up to {model.pe.max_positions}"
        else:
            try:
                cell = trials(name, length, depth, count, tokenizer.encode, SEED, haystack)
            except DataError:  # a character outside a char-level vocabulary
                cell = "the tokenizer cannot encode its prompt (a char-level vocabulary without some of its characters)"
            if isinstance(cell, str):
                row["reason"] = cell
            else:
                revisit()
                got = greedy_answers(model, [t.prompt for t in cell], probe.answer_tokens, length)
                scores = [probe.score(tokenizer.decode(ids), t.answers) for ids, t in zip(got, cell, strict=True)]
                row.update(score=sum(scores) / len(scores), applicable=True)
        rows.append(row)
        if on_cell is not None:
            on_cell(1)
    return rows
