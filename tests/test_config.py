"""GPTConfig validation, serialisation, and the promise that `model` never imports Lightning."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from model import ATTN_BACKENDS, POS_ENCODINGS, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def test_choices_are_the_documented_ones():
    assert set(POS_ENCODINGS) == {"learned", "sinusoidal", "rope", "alibi", "t5", "none"}
    assert set(ATTN_BACKENDS) == {"auto", "eager", "sdpa", "flex", "chunked"}
    assert GPTConfig().rope_base == 10000.0


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"n_embd": 30, "n_head": 4}, ["n_embd (30)", "n_head (4)", "divisible"]),
        ({"n_embd": 12, "n_head": 4, "pos_encoding": "rope"}, ["rope", "even", "3"]),
        ({"n_embd": 9, "n_head": 3, "pos_encoding": "sinusoidal"}, ["sinusoidal", "even"]),
        ({"pos_encoding": "rotary"}, ["pos_encoding", "'rotary'", "learned", "alibi", "none"]),
        ({"attn_backend": "flash"}, ["attn_backend", "'flash'", "sdpa", "flex", "eager", "auto"]),
        ({"attn_sinks": 2}, ["attn_sinks", "attn_window > 0"]),
        ({"attn_window": -1}, ["attn_window", ">= 0"]),
        ({"n_layer": 0}, ["n_layer", "positive"]),
        ({"vocab_size": 1.5}, ["vocab_size", "positive integer"]),
        ({"dropout": 1.0}, ["dropout", "[0, 1)"]),
        ({"rope_base": 0.0}, ["rope_base", "positive"]),
    ],
)
def test_invalid_values_fail_at_construction_naming_field_and_fix(overrides, needles):
    with pytest.raises(ValueError) as info:
        GPTConfig(**overrides)
    for needle in needles:
        assert needle in str(info.value)


def test_an_explicit_kernel_that_cannot_run_the_model_fails_at_construction():
    from model import GPT

    config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, attn_backend="flex", dropout=0.1)
    with pytest.raises(ValueError, match="'flex' cannot run.*attention dropout.*Kernels that can: eager, sdpa"):
        GPT(config)


def test_config_is_frozen_and_keyword_only():
    config = GPTConfig(n_layer=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_layer = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPTConfig(50304)  # type: ignore[misc]


def test_head_dim_is_derived():
    assert GPTConfig(n_embd=384, n_head=6).head_dim == 64


def test_dict_round_trip_and_unknown_key():
    config = GPTConfig(vocab_size=65, pos_encoding="alibi", rope_base=500.0)
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig.from_dict({**config.to_dict(), "n_layers": 3})


def test_import_boundaries():
    """`model` never imports Lightning; evaluation and sampling import neither Lightning nor `training`."""
    code = (
        "import sys, model; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]; "
        "assert not bad, ('model', bad); "
        "import evaluate, sample, evaluation.run, evaluation.report; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'training')]; "
        "assert not bad, ('evaluation', bad)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _imports(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_import_cycle_inside_model():
    modules = {f"model.{p.stem}": _imports(p) for p in (ROOT / "model").glob("*.py") if p.stem != "__init__"}
    graph = {m: {i for i in imports if i in modules} for m, imports in modules.items()}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in graph[start])

    cycles = [m for m in graph if reaches(m, m, {m})]
    assert not cycles, cycles


def test_run_config_defaults_are_the_default_run():
    import train as train_script
    from core import cli
    from training.config import RunConfig

    parsed = cli.parse(train_script.COMMAND, [])
    defaults = RunConfig()
    for section in ("model", "data", "optim", "train"):
        assert getattr(parsed, section) == getattr(defaults, section), section
