"""The fidelity table of docs/model.md (each scheme against its paper's code): every row names tests
that exist, and every registered position scheme, attention function and score has a row, so that a
new registry entry without one fails here. Also the two formulas no other test wrote out by hand:
learned positions and NoPE, and RoPE's rotation."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import torch

from posgpt.model import GPT, GPTConfig
from posgpt.model.attention import ATTENTIONS
from posgpt.model.positions import SCHEMES
from posgpt.model.scores import SCORES

from helpers import fidelity

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Fidelity: each scheme against its paper's code"
COLUMNS = ["what", "paper", "official code followed", "default", "deviations (option)", "pinned by"]
PINNED = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)(?:\[[^\]`]*\])?`")


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row; `\\|` is a pipe inside a cell."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def fidelity_rows(text: str) -> list[dict[str, str]]:
    """The rows of the fidelity table of `text` (docs/model.md)."""
    assert text.count(HEADING) == 1, f"docs/model.md has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert _cells(lines[0]) == COLUMNS and set(lines[1]) <= set("|-: ")
    rows = [dict(zip(COLUMNS, _cells(line), strict=True)) for line in lines[2:]]
    assert rows
    return rows


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def fidelity_problems(text: str) -> list[str]:
    """What is wrong with the fidelity table of `text`: a row without a test that exists, an empty cell, a
    registered scheme, attention function or score without a row."""
    problems = []
    rows = fidelity_rows(text)
    for row in rows:
        pinned = PINNED.findall(row["pinned by"])
        if not pinned or not all(row[column] for column in COLUMNS):
            problems.append(f"row {row['what']!r} has an empty cell or names no test as `tests/file.py::test_name`")
        for file, name in pinned:
            path = ROOT / file
            if not path.is_file() or name not in _test_functions(path):
                problems.append(f"{row['what']}: {file}::{name} does not exist")
    what = " ".join(row["what"] for row in rows)
    for field, registry in (("pos_encoding", SCHEMES), ("attention", ATTENTIONS), ("attn_score", SCORES)):
        problems += [f"no row for {field} {key}" for key in registry if f"`{field}: {key}`" not in what]
    return problems


def test_every_row_is_pinned_by_tests_that_exist_and_every_registry_key_has_a_row():
    assert fidelity_problems((ROOT / "docs" / "model.md").read_text()) == []


def test_the_table_check_can_fail():
    assert _cells(r"| a | ψ(\|c\|x) | `tests/x.py::test_y[p]` |") == ["a", r"ψ(\|c\|x)", "`tests/x.py::test_y[p]`"]
    assert PINNED.findall("`tests/test_a.py::test_b[one-2]`, `tests/test_c.py::test_d`") == [
        ("tests/test_a.py", "test_b"), ("tests/test_c.py", "test_d")]  # fmt: skip
    assert "test_not_a_real_test" not in _test_functions(ROOT / "tests" / "test_positions.py")


BASE = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=False)


@fidelity(
    "`pos_encoding: learned`",
    paper="GPT-2 (Radford et al. 2019)",
    code="openai/gpt-2 `src/model.py` (`wpe`)",
    default="a trained vector per position added to the token embedding",
    deviations="init N(0, 0.02²) as nanoGPT and Hugging Face; openai/gpt-2 draws `wpe` with std 0.01 (no option)",
)
@fidelity(
    "`pos_encoding: none`",
    paper="Kazemnejad et al. 2023 (NoPE)",
    code="none: nothing to follow",
    default="no position signal; the causal mask only",
    deviations="none",
)
def test_learned_positions_add_their_row_and_nope_adds_nothing():
    """Learned (GPT-2): token embedding + the table's row of each position; NoPE: the embeddings, queries
    and keys as they are, and no score bias."""
    learned = GPT(dataclasses.replace(BASE, pos_encoding="learned")).pe
    x = torch.randn(2, 5, 16)
    at_3 = learned.embed(x, torch.arange(3, 8)[None])
    torch.testing.assert_close(at_3, x + learned.table.weight[3:8], rtol=0, atol=0)
    nope = GPT(dataclasses.replace(BASE, pos_encoding="none")).pe
    q, k = torch.randn(2, 1, 2, 5, 8).unbind(0)
    assert nope.embed(x) is x and all(a is b for a, b in zip(nope.rotate(q, k), (q, k), strict=True))
    assert not nope.terms and not nope.uses_positions and not list(nope.parameters())


@fidelity(
    "`pos_encoding: rope`",
    paper="Su et al. 2021 (RoFormer)",
    code="EleutherAI/gpt-neox `RotaryEmbedding` (rotate-half)",
    default="pair i turns by b^(−2i/D) per position, float32",
    deviations=(
        "pairs are dimensions (i, i + D/2), not RoFormer's (2i, 2i + 1): a fixed permutation of q and k (no option)"
    ),
)
def test_rope_turns_pair_i_and_i_plus_half_by_position_times_base_to_the_minus_2i_over_d():
    """RoPE written out pair by pair: dimensions (i, i + D/2) rotated by the angle p · b^(−2i/D)."""
    pe = GPT(dataclasses.replace(BASE, pos_encoding="rope", rope_base=500.0)).pe
    D, start = 8, 6
    q = torch.randn(1, 2, 4, D, dtype=torch.float64)
    got = pe.rotate(q.float(), q.float(), torch.arange(start, start + 4)[None])[0].double()
    expected = q.clone()
    for i in range(D // 2):
        angle = torch.arange(start, start + 4, dtype=torch.float64) * 500.0 ** (-2 * i / D)
        a, b = q[..., i], q[..., i + D // 2]
        expected[..., i] = a * angle.cos() - b * angle.sin()
        expected[..., i + D // 2] = b * angle.cos() + a * angle.sin()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
