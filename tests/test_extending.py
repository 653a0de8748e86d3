"""docs/extending.md's worked examples, run: a new kernel, a new attention function and a new position
scheme, each one class and one registry line, are validated, chosen, trained and decoded; the new
kernel goes through the whole parity matrix of test_kernels.py, the new function through its causality
check, the new scheme through both and through FlexAttention's gradient check."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, SCHEMES
from posgpt.model.kernels import KERNELS
from posgpt.model.scores import SCORES
from posgpt.model.terms import Term

import test_kernels
from helpers import overfit, uncompiled_flex
from test_kernels import TINY, assert_matches_reference, parity_cases, runnable

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
REGISTRIES = {"KERNELS": KERNELS, "ATTENTIONS": ATTENTIONS, "SCHEMES": SCHEMES}


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


@pytest.fixture
def registered(monkeypatch) -> dict[str, object]:
    """The doc's classes, executed, and its registry lines applied to the registries (for this test only)."""
    namespace: dict[str, object] = {}
    registry_lines = {}
    for block in _blocks():
        head = block.split(":", 1)[0]
        if head in REGISTRIES:  # the doc's registry literal: its last entry is the new line
            registry_lines[head] = re.findall(r'"(\w+)": (\w+)(\(\))?,', block)[-1]
        else:
            exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - the project's own documentation
    for registry, target in REGISTRIES.items():
        name, cls, call = registry_lines[registry]
        monkeypatch.setitem(target, name, namespace[cls]() if call else namespace[cls])
    return namespace


def test_the_doc_adds_exactly_one_registry_line_each():
    blocks = [b for b in _blocks() if b.split(":", 1)[0] in REGISTRIES]
    assert len(blocks) == len(REGISTRIES)
    for block in blocks:  # the registry as it stands, plus the new line
        registry = REGISTRIES[block.split(":", 1)[0]]
        names = re.findall(r'"(\w+)":', block)
        assert names[:-1] == list(registry) and names[-1] not in registry


@pytest.mark.slow
def test_the_new_kernel_is_validated_chosen_and_matched_against_eager(registered, tiny_config):
    config = dataclasses.replace(tiny_config, pos_encoding="alibi", attn_backend="math")
    with pytest.raises(ConfigError, match="attn_backend='math' cannot run attn_score='additive'"):
        dataclasses.replace(config, attn_score="additive")
    cases = {label: (case, name) for label, case, name, _ in parity_cases(TINY) if name == "math"}
    other_dot_scores = [name for name, score in SCORES.items() if score.dot_product and name != "scaled_dot"]
    # every scheme, with no mask and each of test_kernels' masks; each other dot-product score (dot, general)
    # on 3 schemes; for each function whose kernels are softmax's (softmax, differential, forgetting)
    functions = [name for name, layer in ATTENTIONS.items() if layer.kernels is KERNELS]
    fused = [
        name for name, scheme in SCHEMES.items() if Term.FROM_SCORES not in scheme.terms
    ]  # CoPE: kernels that form scores
    per_function = 3 * len(other_dot_scores) + len(fused)  # the scores on 3 schemes; every scheme unmasked
    masked = len(fused) + (len(functions) - 1) * len(test_kernels.SCORE_SCHEMES)  # softmax: every scheme
    assert len(cases) == len(functions) * per_function + masked * len(test_kernels.MASKS)
    for case in cases.values():
        assert_matches_reference(*case)
    layer = ATTENTIONS["softmax"]
    needs = layer.needs(GPT(config).pe, GPT(config).mask, SCORES["scaled_dot"], torch.device("cpu"))
    assert layer.choose_kernel("auto", needs, torch.device("cpu")) is KERNELS["sdpa"]  # its rank is after sdpa's


def test_the_new_attention_function_trains_decodes_and_draws_its_weights(registered, tiny_config):
    config = dataclasses.replace(tiny_config, attention="relu", pos_encoding="alibi")
    model = GPT(config)
    assert all(type(block.attn) is registered["ReluAttention"] for block in model.blocks)
    _, final = overfit(model, steps=60, lr=1e-2)
    assert final < 0.5
    model.eval()
    prompt = torch.randint(0, config.vocab_size, (2, 3))
    for extra in ({}, {"attn_window": 4}):
        windowed = GPT(dataclasses.replace(config, **extra)).eval()
        windowed.load_state_dict(model.state_dict())
        cached, uncached = (windowed.generate(prompt, 20, temperature=0, use_cache=c) for c in (True, False))
        assert torch.equal(cached, uncached)
    rows: list[torch.Tensor] = []
    idx = torch.randint(0, config.vocab_size, (1, 9))
    logits = model.attention_weights(idx, lambda layer: (lambda r, w: rows.append(w)) if layer == 0 else None)
    torch.testing.assert_close(logits, model(idx)[0])
    weights = torch.cat(rows, dim=2)  # (1, H, 9, 9): relu(score) / n, zero on the keys a query cannot see
    visible = torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.all(weights[..., ~visible] == 0) and torch.all(weights >= 0) and (weights[..., visible] > 0).any()


def test_the_causality_check_runs_on_the_new_function_with_every_scheme(registered, tiny_config):
    schemes = [s for s in SCHEMES if runnable(TINY, attention="relu", pos_encoding=s)]
    assert schemes == list(SCHEMES)
    for scheme in schemes:
        test_kernels.test_future_tokens_never_change_past_logits(tiny_config, "relu", "eager", scheme)
    with pytest.raises(ConfigError, match="attn_backend='sdpa' is not a kernel of attention='relu'"):
        dataclasses.replace(TINY, attention="relu", attn_backend="sdpa")
    dataclasses.replace(TINY, attention="relu", dropout=0.1)  # the eager kernel's dropout, inherited


@pytest.mark.slow
def test_the_new_scheme_trains_decodes_matches_every_kernel_and_keeps_its_gradient_in_flex(
    registered, tiny_config, monkeypatch
):
    config = dataclasses.replace(tiny_config, pos_encoding="learned_slopes")
    model = GPT(config)
    assert type(model.pe) is registered["LearnedSlopes"] and model.pe.terms == {Term.POSITIONS}
    _, final = overfit(model, steps=60, lr=1e-2)
    assert final < 0.5 and model.pe.slopes.grad is not None
    model.eval()
    prompt = torch.randint(0, config.vocab_size, (2, 3))
    cached, uncached = (model.generate(prompt, 20, temperature=0, use_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached)
    uncompiled_flex(monkeypatch)  # flex's exact uncompiled path, forward only, as test_kernels.py runs it here
    cases = [(case, name) for _, case, name, _ in parity_cases(TINY) if case.pos_encoding == "learned_slopes"]
    assert {name for _, name in cases} >= {"sdpa", "flex", "math"}
    for case in cases:
        assert_matches_reference(*case)
    test_kernels.test_future_tokens_never_change_past_logits(tiny_config, "softmax", "sdpa", "learned_slopes")
    test_kernels.test_flex_carries_the_gradient_of_every_learned_bias(tiny_config, {"pos_encoding": "learned_slopes"})
