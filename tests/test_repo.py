"""Rules of the repository: the README's install and test commands are the ones CI runs, in a fresh
environment; no test monkeypatches torch's config modules; no code branches on a configured name (and that
check can fail); every relative link of the README and docs/ leads somewhere; the docs name every config field
and every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import project_files

ROOT = Path(__file__).resolve().parents[1]


def _commands(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_install_and_test_commands_in_a_fresh_environment():
    """A green CI is a green README: `.ci/run` clones the commit, creates `.venv` inside the clone as the README
    does, without the machine's site packages, activates it, and runs the README's install-and-test line verbatim,
    then the wheel check,
    so CI tests the releases a fresh install resolves (pytest 9.2 broke the suite while CI's
    preinstalled 9.0.3 stayed green), not the CI image's."""
    script = (ROOT / ".ci" / "run").read_text()
    commands = _commands(script)
    *_, last, wheel = commands  # then the wheel alone, outside the checkout
    assert wheel == "[ $? -eq 0 ] && bash .ci/wheel_check.sh" and (ROOT / ".ci" / "wheel_check.sh").is_file()
    assert "pip install -e" in last and "ruff check" in last and last.endswith("python -m pytest -q -n auto")
    readme_lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    assert last in readme_lines
    creates = [i for i, c in enumerate(commands) if c.startswith("python -m venv ")]
    activates = [i for i, c in enumerate(commands) if c.startswith(". ") and c.endswith('/bin/activate"')]
    assert creates and activates and creates[0] < activates[0] < len(commands) - 2
    assert "--system-site-packages" not in script
    clones = [i for i, c in enumerate(commands) if c.startswith("git clone -q . ")]  # the commit, in a clone
    assert clones and clones[0] < creates[0] and commands[creates[0]] == "python -m venv .venv"  # the README's
    assert "python -m venv .venv" in (ROOT / "README.md").read_text() and ".venv/" in (ROOT / ".gitignore").read_text()


TORCH_CONFIG_MONKEYPATCH = re.compile(r"monkeypatch\.(?:set|del)attr\(\s*[\"']?torch\.[\w.]*config\b")
"""pytest's monkeypatch on a torch config module (torch._dynamo.config, torch._inductor.config, ...):
from pytest 9.2 its undo deletes the setting instead of restoring it. `config.patch(...)` instead."""


def test_no_test_monkeypatches_a_torch_config_module():
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if TORCH_CONFIG_MONKEYPATCH.search(line)
    ]
    assert not found, f"patch torch's settings with torch._dynamo.config.patch(...): {found}"
    call = "monkeypatch" + ".setattr("  # (spelled apart, so that this file holds no such call itself)
    assert TORCH_CONFIG_MONKEYPATCH.search(call + 'torch._dynamo.config, "x", False)')
    assert TORCH_CONFIG_MONKEYPATCH.search(call + '"torch._inductor.config.x", 1)')
    assert not TORCH_CONFIG_MONKEYPATCH.search(call + 'torch.cuda, "is_available", f)')


NAMED_SETTINGS = {"pos_encoding", "attention", "attn_score", "attn_backend"}
"""Config fields whose values are registry names: code reads what the registered class declares."""


def _compares_a_name_to_a_literal(node: ast.Compare) -> bool:
    operands = [node.left, *node.comparators]

    def named(x: ast.AST) -> bool:
        if isinstance(x, ast.Attribute):
            return x.attr in NAMED_SETTINGS or (x.attr in ("name", "function") and "kernel" in ast.unparse(x.value))
        if isinstance(x, ast.Subscript):  # settings["attention"]
            key = x.slice
            return isinstance(key, ast.Constant) and key.value in NAMED_SETTINGS
        return isinstance(x, ast.Name) and x.id in NAMED_SETTINGS

    def literal(x: ast.AST) -> bool:
        if isinstance(x, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(e) for e in x.elts)
        return isinstance(x, ast.Constant) and isinstance(x.value, str)

    return any(named(x) for x in operands) and any(literal(x) for x in operands)


def test_no_code_branches_on_the_name_of_a_scheme_function_score_or_kernel():
    """Capabilities, not names: outside the registries and `GPTConfig.__post_init__`, no code in
    model/, evaluation/, experiments/ or training/ compares such a name to a string literal."""
    found = []
    for package in ("model", "evaluation", "experiments", "training"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            allowed = {
                id(node)
                for cls in ast.walk(tree)
                if isinstance(cls, ast.ClassDef) and cls.name == "GPTConfig" and path == ROOT / "model" / "config.py"
                for fn in cls.body
                if isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__"
                for node in ast.walk(fn)
            }
            found += [  # `match config.attention: case "linear":` is the same branch
                f"{path.relative_to(ROOT)}:{node.lineno}: match {ast.unparse(node.subject)}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Match)
                and any(
                    _compares_a_name_to_a_literal(ast.Compare(node.subject, [ast.Eq()], [case.pattern.value]))
                    for case in node.cases
                    if isinstance(case.pattern, ast.MatchValue)
                )
            ]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Compare) and id(node) not in allowed and _compares_a_name_to_a_literal(node)
            ]
    assert not found, found


def test_the_check_above_can_fail():
    tree = ast.parse(
        'if config.pos_encoding == "rope" or kernel.name != "flex" or attention in ("linear",) '
        'or settings["attn_score"] == "dot": pass'
    )
    assert sum(_compares_a_name_to_a_literal(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)) == 4
    assert not _compares_a_name_to_a_literal(ast.parse('config.rope_scaling == "ntk"').body[0].value)


def test_the_links_of_the_readme_and_the_docs_lead_somewhere():
    """The README starts where users start; the reference lives in docs/, and every relative link of the README and
    of docs/*.md names a file or directory that exists."""
    readme = ROOT / "README.md"
    pages = [readme, *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 5
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_docs_name_every_config_field_and_every_module():
    """docs/model.md lists GPTConfig's fields and docs/development.md's layout table names every module:
    a new field or file that the docs miss fails here."""
    import dataclasses

    from posgpt.model import GPTConfig

    model_doc = (ROOT / "docs" / "model.md").read_text()
    assert [f.name for f in dataclasses.fields(GPTConfig) if f"`{f.name}`" not in model_doc] == []
    layout = (ROOT / "docs" / "development.md").read_text()
    files = [str(p.relative_to(ROOT)) for p in project_files("*.py")]
    modules = [f for f in files if not f.startswith("tests/") and Path(f).name not in ("__init__.py", "__main__.py")]
    assert modules and [f for f in modules if f"`{Path(f).name}`" not in layout] == []
