"""Exact-match accuracy of a model on a synthetic task (`data.tasks`) at every test length: the
model answers each prompt greedily, with the KV cache, and is right when every answer token is."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from posgpt.core.threads import revisit
from posgpt.data.tasks import TASKS, Example, TaskConfig, eval_set
from posgpt.data.tokenizer import CharTokenizer
from posgpt.evaluation.attention_stats import runs_at
from posgpt.model.gpt import GPT


@torch.no_grad()
def correct(model: GPT, tokenizer: CharTokenizer, examples: list[Example], batch_size: int) -> list[list[bool]]:
    """Which answer tokens the model gets right, per example: exact match is all of them. Each batch holds
    prompts of one length and answers of one length (counting's prompts of n steps differ in length)."""
    device = model.wte.weight.device
    encoded = [(tokenizer.encode(e.prompt), tokenizer.encode(e.answer)) for e in examples]
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, (prompt, answer) in enumerate(encoded):
        shapes.setdefault((len(prompt), len(answer)), []).append(i)
    results: list[list[bool]] = [[] for _ in examples]
    for (length, n), members in shapes.items():
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            prompts = torch.tensor([encoded[i][0] for i in chunk], device=device)
            answers = torch.tensor([encoded[i][1] for i in chunk], device=device)
            revisit()
            got = model.generate(prompts, n, temperature=0.0, max_context=length + n)[:, length:]  # greedy, cached
            for i, row in zip(chunk, (got == answers).tolist(), strict=True):
                results[i] = row
    return results


def evaluate_task(
    model: GPT,
    tokenizer: CharTokenizer,
    task: TaskConfig,
    batch_size: int = 50,
    on_done: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows of exact-match and per-token accuracy at every `task.eval_lengths` (and depth, for a task with
    depths); a length that learned positions cannot reach is n/a."""
    model.eval()
    rows = []
    depths: list[float | None] = list(task.test_depths) if TASKS[task.name].depths else [None]
    for n, depth in itertools.product(task.eval_lengths, depths):
        examples = eval_set(task, n, depth)
        longest = max(len(e.prompt) + len(e.answer) for e in examples) - 1
        row: dict[str, Any] = {"length": n, "depth": depth, "tokens": longest + 1, "examples": len(examples)}
        if not runs_at(model, longest):
            row.update(accuracy=None, token_accuracy=None, applicable=False,
                       reason=f"{longest} tokens > {model.pe.max_positions} learned positions")  # fmt: skip
        else:
            tokens = correct(model, tokenizer, examples, batch_size)
            row.update(
                accuracy=sum(all(t) for t in tokens) / len(tokens),
                token_accuracy=sum(map(sum, tokens)) / sum(map(len, tokens)),  # partial credit
                applicable=True,
                reason=None,
            )
        rows.append(row)
        if on_done:
            on_done(len(examples))
    return rows
