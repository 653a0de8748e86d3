"""GPTConfig validation, serialisation, and the import boundaries: `model` never imports Lightning,
`core/` and `data/` nothing above them."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPTConfig
from posgpt.model.validation import kernel_names

ROOT = Path(__file__).resolve().parents[1]


REGISTRY_FIELDS = {
    "pos_encoding": "SCHEMES",
    "attention": "ATTENTIONS",
    "attn_score": "SCORES",
    "attn_backend": "kernels",
}
"""The GPTConfig fields whose values are registry keys, and the registry (kernels: every function's)."""


def registry_keys() -> dict[str, list[str]]:
    """Each registry-valued field's keys as they stand (a test may have registered more)."""
    from posgpt.model import SCHEMES
    from posgpt.model.scores import SCORES

    registries = {"SCHEMES": list(SCHEMES), "ATTENTIONS": list(ATTENTIONS), "SCORES": list(SCORES)}
    return {field: kernel_names() if name == "kernels" else registries[name] for field, name in REGISTRY_FIELDS.items()}


def field_docstrings(path: Path = ROOT / "model" / "config.py", owner: str = "GPTConfig") -> dict[str, str]:
    """The docstring under each field of class `owner` in `path` (what --help and docs/config.md show)."""
    import ast

    body = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == owner).body
    return {
        field.target.id: text.value.value
        for field, text in zip(body, body[1:], strict=False)
        if isinstance(field, ast.AnnAssign) and isinstance(text, ast.Expr) and isinstance(text.value, ast.Constant)
    }


def undocumented(model_doc: str, docstrings: dict[str, str]) -> list[str]:
    """Registry keys that docs/model.md (`model_doc`) or their field's docstring does not name."""
    missing = []
    for field, keys in registry_keys().items():
        for key in keys:
            named = f"`{key}`" in model_doc or f"`{field}: {key}`" in model_doc  # a table's row
            if not named or not re.search(rf"\|\s*{key}\b|\b{key}\s*[|(]", docstrings[field]):  # in its `a | b` list
                missing.append(f"{field}: {key}")
    return missing


def test_choices_are_the_documented_ones():
    """Every registry entry is named in docs/model.md and in the docstring of the field that takes it (--help), read
    from the registries, not a pinned list; so are the synthetic tasks in TaskConfig.name's."""
    from posgpt.data.tasks import TASKS

    assert undocumented((ROOT / "docs" / "model.md").read_text(), field_docstrings()) == []
    assert undocumented("", {field: "" for field in REGISTRY_FIELDS})  # the check can fail
    task_doc = field_docstrings(ROOT / "data" / "tasks.py", "TaskConfig")["name"]
    assert [name for name in TASKS if not re.search(rf"\b{name}\b", task_doc)] == []


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"n_embd": 30, "n_head": 4}, ["n_embd (30)", "n_head (4)", "divisible"]),
        ({"n_embd": 12, "n_head": 4, "pos_encoding": "rope"}, ["rope", "even", "3"]),
        ({"n_embd": 9, "n_head": 3, "pos_encoding": "sinusoidal"}, ["sinusoidal", "even"]),
        ({"pos_encoding": "rotary"}, ["pos_encoding", "'rotary'", "learned", "alibi", "none"]),
        ({"pos_encoding": "alibl"}, ["got 'alibl'; did you mean alibi?"]),
        ({"attn_backend": "flash"}, ["attn_backend", "'flash'", "sdpa", "flex", "eager", "auto"]),
        ({"attention": "sigmod"}, ["attention", "'sigmod'", "softmax", "linear", "did you mean sigmoid?"]),
        ({"attn_score": "bilinear"}, ["attn_score", "scaled_dot", "additive"]),
        ({"attn_sinks": 2}, ["attn_sinks", "attn_window > 0"]),
        ({"attn_window": -1}, ["attn_window", ">= 0"]),
        ({"n_layer": 0}, ["n_layer", "positive"]),
        ({"vocab_size": 1.5}, ["vocab_size", "positive integer"]),
        ({"dropout": 1.0}, ["dropout", "[0, 1)"]),
        ({"rope_base": 0.0}, ["rope_base", "positive"]),
        ({"pos_encoding": "t5", "t5_num_buckets": 32, "t5_max_distance": 16}, ["t5_max_distance above half"]),
        ({"pos_encoding": "rope", "n_embd": 8, "n_head": 4, "rope_scaling": "ntk"}, ["'ntk'", "D / (D - 2)"]),
    ],
)
def test_invalid_values_fail_at_construction_naming_field_and_fix(overrides, needles):
    with pytest.raises(ValueError) as info:
        GPTConfig(**overrides)
    for needle in needles:
        assert needle in str(info.value)


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
    """Importing GPTConfig imports no kernel and no FlexAttention; `model` never imports Lightning;
    evaluation and sampling import neither Lightning nor `training`."""
    code = (
        "import sys; from posgpt.model import GPTConfig; "
        "bad = [m for m in sys.modules if m.startswith(('posgpt.model.kernels', 'torch.nn.attention.flex'))]; "
        "assert not bad, ('GPTConfig', bad); "
        "from posgpt.model import GPT; GPTConfig(); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]; "
        "assert not bad, ('model', bad); "
        "import evaluate, sample, posgpt.evaluation.run, posgpt.evaluation.report; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning') "
        "or m.startswith('posgpt.training')]; "
        "assert not bad, ('evaluation', bad)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _imports(path: Path) -> set[str]:
    """The modules `path` imports when it runs, in a function or at its top (imports under `if TYPE_CHECKING:` are for
    annotations only): `from a.b import c` names a.b.c where that is a module, else a.b."""
    import ast

    def runtime(node: ast.AST) -> bool:
        return not (isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING")

    names: set[str] = set()
    pending = [ast.parse(path.read_text())]
    while pending:
        for node in ast.iter_child_nodes(pending.pop()):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.update({node.module} | {f"{node.module}.{alias.name}" for alias in node.names})
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif runtime(node):
                pending.append(node)
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "posgpt" else ("posgpt", *parts))


def test_no_module_imports_itself_back_at_runtime():
    """The modules of posgpt import one another without a cycle, at their top or inside a function."""
    files = [p for package in {p.parent for p in ROOT.glob("*/__init__.py")} - {ROOT / "tests"}
             for p in package.rglob("*.py")]  # fmt: skip
    modules = {_module_name(p): _imports(p) for p in files}
    assert "posgpt.model.gpt" in modules and "posgpt.cli" in modules
    graph = {m: {i for i in imports if i in modules and i != m} for m, imports in modules.items()}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in graph[start])

    cycles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not cycles, cycles


BELOW = {
    "core": ("data", "model", "training", "evaluation", "experiments"),
    "data": ("model", "training", "evaluation", "experiments"),
}
"""Packages that everything above may use, and the packages they must not import: `core/` holds what
needs no model and no data (errors, files, devices, reading a checkpoint file), `data/` no model."""


@pytest.mark.parametrize("package", BELOW)
def test_lower_packages_import_nothing_above_them(package):
    above = BELOW[package]
    bad = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / package).glob("*.py")
        for name in _imports(path)
        if name.split(".")[:2] in (["posgpt", package] for package in above)
    )
    assert not bad, bad


def test_run_config_defaults_are_the_default_run():
    import train as train_script
    from posgpt.core import cli
    from posgpt.training.config import RunConfig

    parsed = cli.parse(train_script.COMMAND, [])
    defaults = RunConfig()
    for section in ("model", "data", "optim", "train"):
        assert getattr(parsed, section) == getattr(defaults, section), section


def test_a_field_declared_with_roles_takes_them_with_no_list_edited(tiny_config):
    """Each role is read from the fields' declarations (`model.roles`): a new field declared a kind's, switchable,
    resumable and acting on the queries is set by a kind, changed by a switch and a resume, refused without a score;
    a scheme's field is switchable and a kind's."""
    from posgpt.model import GPT
    from posgpt.model.roles import Role, role
    from posgpt.training.config import RunConfig
    from posgpt.training.rundir import same_run_differences

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(GPTConfig):
        new_field: int = role(0, Role.KIND, Role.SWITCH, Role.RESUME, Role.QUERY)
        scheme_knob: float = role(1.0, scheme="rope")

    config = Extended(**{**tiny_config.to_dict(), "pos_encoding": "rope"})
    for role_ in (Role.KIND, Role.SWITCH, Role.RESUME, Role.QUERY):
        assert "new_field" in config.fields_with(role_)
    assert "new_field" not in config.fields_with(Role.LAYER) and "new_field" not in GPTConfig.fields_with(Role.KIND)
    assert config.scheme_fields("rope")[-1] == "scheme_knob" and "scheme_knob" in config.fields_with(Role.SWITCH)
    kinds = dataclasses.replace(config, layout=("a", "b"), kinds={"a": {"new_field": 3, "scheme_knob": 2.0}, "b": {}})
    assert GPT(kinds).kinds[0].config.new_field == 3
    with pytest.raises(ConfigError, match="sets n_head, which a kind cannot set"):
        dataclasses.replace(kinds, kinds={"a": {"n_head": 2}, "b": {}})
    model = GPT(config)
    model.switch(dataclasses.replace(config, new_field=2, scheme_knob=3.0))
    assert model.config.new_field == 2
    with pytest.raises(ValueError, match="not n_embd"):
        model.switch(dataclasses.replace(config, n_embd=64))
    saved = dataclasses.asdict(RunConfig(model=config))
    assert same_run_differences(saved, RunConfig(model=dataclasses.replace(config, new_field=5)), "checkpoint") == []
    assert same_run_differences(saved, RunConfig(model=dataclasses.replace(config, scheme_knob=5.0)), "checkpoint")
    with pytest.raises(ConfigError, match="new_field acts on the queries of a score"):
        dataclasses.replace(config, attention="linear", new_field=1)


def test_the_config_reference_lists_every_shipped_config():
    """Issue 57: docs/config.md listed 13 of the 21 shipped configs."""
    text = (ROOT / "docs" / "config.md").read_text()
    assert [p.name for p in sorted((ROOT / "configs").glob("*.yaml")) if f"| `configs/{p.name}` |" not in text] == []
