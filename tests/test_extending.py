"""docs/extending.md's worked examples, added as it says: a new kernel, a new attention function and a new position
scheme, each one class and one registry line, with the docs rows, docstring names and tests its checklists name.
Registered here, they are validated, chosen, trained and decoded, and go through the suites that read the
registries: the parity matrix and causality check of test_kernels.py (logits and gradients), the cache matrix of
test_cache.py, `posgpt check`'s grid, FlexAttention's gradient check, and the docs and fidelity-table checks."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import docs_tables
import pytest
import test_cache
import test_config
import test_fidelity_table
import torch

from posgpt.core.errors import ConfigError
from posgpt.evaluation import check
from posgpt.model import ATTENTIONS, GPT, SCHEMES
from posgpt.model.kernels import KERNELS
from posgpt.model.positions import alibi_slopes
from posgpt.model.scores import SCORES
from posgpt.model.terms import Term

import test_kernels
from helpers import assert_model_is_its_formula, fidelity, layer_variants, overfit, uncompiled_flex
from test_kernels import TINY, assert_matches_reference, parity_cases, runnable

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"
REGISTRIES = {"KERNELS": KERNELS, "ATTENTIONS": ATTENTIONS, "SCHEMES": SCHEMES}


def _blocks(language: str = "python") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


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
    for block in blocks:  # the registry as it stands, plus the new line (or with it, once added for real)
        registry = REGISTRIES[block.split(":", 1)[0]]
        names = re.findall(r'"(\w+)":', block)
        assert names[:-1] == [name for name in registry if name != names[-1]]


def test_the_docs_are_written_with_the_new_entries_and_pass_the_docs_checks(registered, tmp_path):
    """The docs as they stand miss the new entries (the docs checks catch that); what tests/docs_tables.py writes
    with them registered names each in its field's docstring, gives the scheme and the kernel their rows, and takes
    the function's and the scheme's fidelity rows from their formula tests below: the docs checks then pass."""
    new = {"pos_encoding: learned_slopes", "attention: relu", "attn_backend: math"}
    model_doc = (ROOT / "docs" / "model.md").read_text()
    assert set(test_config.undocumented(model_doc, test_config.field_docstrings())) <= new
    written = docs_tables.written()
    (tmp_path / "config.py").write_text(written[ROOT / "model" / "config.py"])
    model_doc, docstrings = written[ROOT / "docs" / "model.md"], test_config.field_docstrings(tmp_path / "config.py")
    assert test_config.undocumented(model_doc, docstrings) == []
    assert test_fidelity_table.fidelity_problems(model_doc) == []
    rows = {row["what"]: row["pinned by"] for row in test_fidelity_table.fidelity_rows(model_doc)}
    assert "test_extending.py::test_relu_attention_is_its_formula_in_float64" in rows["`attention: relu`"]
    assert "| `learned_slopes` | ALiBi's linear bias" in model_doc and "| `math` | SDPA restricted" in model_doc


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
    fused = [name for name, scheme in SCHEMES.items() if Term.FROM_SCORES not in scheme.terms]  # CoPE: eager only
    per_function = 3 * len(other_dot_scores) + len(fused)  # the scores on 3 schemes; every scheme unmasked
    masked = len(fused) + (len(functions) - 1) * len(test_kernels.SCORE_SCHEMES)  # softmax: every scheme
    options = sum(runnable(TINY, attention=f, attn_backend="math", pos_encoding=test_kernels.SCORE_SCHEMES[0], **extra)
                  is not None for f in functions for extra in layer_variants(TINY).values())  # fmt: skip
    assert len(cases) == len(functions) * per_function + masked * len(test_kernels.MASKS) + options
    for case in cases.values():
        assert_matches_reference(*case)
    layer = ATTENTIONS["softmax"]
    needs = layer.needs(GPT(config).pe, GPT(config).kinds[0].mask, SCORES["scaled_dot"], torch.device("cpu"))
    assert layer.choose_kernel("auto", needs, torch.device("cpu")) is KERNELS["sdpa"]  # its rank is after sdpa's


def test_the_new_attention_function_trains_decodes_and_draws_its_weights(registered, tiny_config):
    config = dataclasses.replace(tiny_config, attention="relu", pos_encoding="alibi")
    model = GPT(config)
    assert all(type(block.attn) is registered["ReluAttention"] for block in model.blocks)
    _, final = overfit(model, steps=60, lr=1e-2)
    assert final < 0.5
    model.eval()
    rows: list[torch.Tensor] = []
    idx = torch.randint(0, config.vocab_size, (1, 9))
    logits = model.attention_weights(idx, lambda layer: (lambda r, w: rows.append(w)) if layer == 0 else None)
    torch.testing.assert_close(logits, model(idx)[0])
    weights = torch.cat(rows, dim=2)  # (1, H, 9, 9): relu(score) / n, zero on the keys a query cannot see
    visible = torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.all(weights[..., ~visible] == 0) and torch.all(weights >= 0) and (weights[..., visible] > 0).any()


@fidelity(
    "`attention: relu`",
    paper="Wortsman et al. 2023",
    code="none: the paper's formula",
    default="relu(score + bias)/n over the n keys a query sees, not normalised",
    deviations="none",
)
def test_relu_attention_is_its_formula_in_float64(registered, tiny_config):
    """Wortsman et al. 2023: query i's output is sum_j relu(q_i . k_j / sqrt(D) + b_ij) v_j / (i + 1) over the
    keys j <= i, b ALiBi's bias; logits and gradients past the training length."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config, attention="relu", pos_encoding="alibi", n_layer=1)
    model = GPT(config).double()
    slopes = alibi_slopes(config.n_head)

    def head(b, i, h, q, k, v, hidden):
        scores = torch.stack([q[b, i, h] @ k[b, j, h] / math.sqrt(config.head_dim) - slopes[h] * (i - j)
                              for j in range(i + 1)])  # fmt: skip
        return torch.relu(scores) / (i + 1) @ v[b, : i + 1, h]

    assert_model_is_its_formula(model, torch.randint(0, config.vocab_size, (2, 2 * config.block_size)), head)


def test_the_causality_check_runs_on_the_new_function_with_every_scheme(registered, tiny_config):
    schemes = [s for s in SCHEMES if runnable(TINY, attention="relu", pos_encoding=s)]
    assert schemes == list(SCHEMES)
    for scheme in schemes:
        test_kernels.test_future_tokens_never_change_past_logits(tiny_config, "relu", "eager", scheme, {})
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
    uncompiled_flex(monkeypatch)  # flex's exact uncompiled path, forward only, as test_kernels.py runs it here
    cases = [(case, name) for _, case, name, _ in parity_cases(TINY) if case.pos_encoding == "learned_slopes"]
    assert {name for _, name in cases} >= {"sdpa", "flex", "math"}
    for case in cases:
        assert_matches_reference(*case)
    test_kernels.test_future_tokens_never_change_past_logits(tiny_config, "softmax", "sdpa", "learned_slopes", {})
    test_kernels.test_flex_carries_the_gradient_of_every_learned_bias(tiny_config, {"pos_encoding": "learned_slopes"})


@fidelity(
    "`pos_encoding: learned_slopes`",
    paper="Press et al. 2022",
    code="ofirpress/attention_with_linear_biases `get_slopes`, for the start",
    default="−m_h·(i − j), m_h learned from ALiBi's slopes",
    deviations="none",
)
def test_learned_slopes_start_as_alibi_and_are_its_formula(registered, tiny_config):
    """Press et al. 2022's bias -m_h (i - j) with m_h the parameter, started at ALiBi's slopes; logits and gradients
    (the slopes' too) in float64, past the training length."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config, pos_encoding="learned_slopes", n_layer=1)
    model = GPT(config).double()
    assert model.pe.slopes.tolist() == alibi_slopes(config.n_head)
    with torch.no_grad():
        model.pe.slopes.mul_(torch.linspace(0.5, 2.0, config.n_head, dtype=torch.float64))  # trained away from ALiBi
    slopes = model.pe.slopes  # the parameter: its gradient is compared too

    def head(b, i, h, q, k, v, hidden):
        scores = torch.stack([q[b, i, h] @ k[b, j, h] / math.sqrt(config.head_dim) - slopes[h] * (i - j)
                              for j in range(i + 1)])  # fmt: skip
        return torch.softmax(scores, 0) @ v[b, : i + 1, h]

    idx = torch.randint(0, config.vocab_size, (2, 2 * config.block_size))
    grads = assert_model_is_its_formula(model, idx, head, tolerance=1e-6)  # its bias is float32, as ALiBi's
    assert grads["pe.slopes"].abs().sum() > 0


@pytest.mark.slow
def test_the_cache_matrix_and_posgpt_check_run_the_new_entries(registered, capsys):
    """The cache matrix's cases of the new scheme, function and kernel (decoding through the cache against none and
    against one full forward, a padded batch's row against itself alone), and `posgpt check`'s grid of them: the
    kernel and the scheme on every function, mask, score and option, the function with its cache and gradients."""
    cases = [param.values[0] for param in test_cache.decoding_cases(test_cache.CONFIG)]
    cases = [c for c in cases if c.pos_encoding == "learned_slopes" or c.attention == "relu"]
    math_kernel = dataclasses.replace(test_cache.CONFIG, attn_backend="math")
    shown = [*test_cache.scheme_kinds().values(), "learned_slopes"]  # the kernel on each kind of scheme, every mask
    cases += [param.values[0] for param in test_cache.decoding_cases(math_kernel)
              if param.id.startswith("softmax-") and param.values[0].pos_encoding in shown]  # fmt: skip
    assert {c.pos_encoding for c in cases} >= {"learned_slopes"} and {c.attention for c in cases} >= {"relu"}
    for config in cases:
        test_cache.test_cached_decoding_gives_the_logits_and_tokens_of_no_cache(config)
        test_cache.test_cached_steps_give_the_logits_of_one_full_forward(config)
        test_cache.test_a_row_in_a_padded_batch_decodes_as_it_would_alone(config)
    names = [name for name, _, _ in check.grid()]
    assert any(name.startswith("relu/learned_slopes/") for name in names)
    ran = []
    for only, quick in (("softmax/learned_slopes/", True), ("relu/rope/causal/scaled_dot", False)):
        ran += [r for r in check.main(check.CheckConfig(quick=quick, only=only)) if r.passed is not None]
    assert ran and all(r.passed for r in ran)
    assert any(r.case.startswith("softmax/learned_slopes/") and r.case.endswith("/math") for r in ran)
    assert {r.check for r in ran if r.case.startswith("relu/")} == {"cache"}  # the reference: its cache checked
    capsys.readouterr()
