"""What the registries, the declarations and the tests write into the docs and the code, so that no one keeps it by
hand: docs/model.md's table of position schemes (each scheme's docstring, what it declares, the kernel `auto` picks)
and its fidelity table (each row from the `@fidelity` mark of the tests that pin it), the names each registry field
takes in `GPTConfig`'s and `TaskConfig`'s docstrings, and the commands' summaries in posgpt/cli.py and
benchmarks/modes.py. `python tests/docs_tables.py` writes them; tests/test_docs_tables.py fails while one is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIDELITY_COLUMNS = ("what", "paper", "official code followed", "default", "deviations (option)", "pinned by")
CELLS = ("paper", "code", "default", "deviations")


def fidelity_marks(tests: Path = ROOT / "tests") -> dict[str, dict[str, Any]]:
    """Each fidelity row by its `what`: its cells (from the one test that gives them), the tests that pin it and
    where its cells are written, read from the source of the test files (nothing is imported or run)."""
    rows: dict[str, dict[str, Any]] = {}
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            for mark in getattr(node, "decorator_list", []):
                if not (isinstance(mark, ast.Call) and getattr(mark.func, "id", None) == "fidelity"):
                    continue
                row = rows.setdefault(ast.literal_eval(mark.args[0]), {"pinned": []})
                row["pinned"].append(f"tests/{path.name}::{node.name}")
                if mark.keywords:
                    if "at" in row or {k.arg for k in mark.keywords} != set(CELLS):
                        raise ValueError(f"{path.name}:{mark.lineno}: a row's cells are {CELLS}, given once")
                    row.update({k.arg: ast.literal_eval(k.value) for k in mark.keywords}, at=(path.name, mark.lineno))
    for what, row in rows.items():
        if "at" not in row:
            raise ValueError(f"no test gives the cells of fidelity row {what!r}: give them on one of its tests")
    return rows


def field_values() -> dict[str, list[Any]]:
    """The values of each `GPTConfig` field that has a list of them: a registry's keys or a Literal's values."""
    from typing import Literal, get_args, get_origin, get_type_hints

    from posgpt.model import GPTConfig
    from posgpt.model.validation import kernel_names, registries

    hints = get_type_hints(GPTConfig)
    values = {name: list(get_args(hint)) for name, hint in hints.items() if get_origin(hint) is Literal}
    return {**values, **registries(kernel_names())}


def _order(what: str, fields: list[str], values: dict[str, list[Any]]) -> tuple[int, int]:
    """A row's place: by the field it names first (in `GPTConfig`'s order), then by its value (in its list)."""
    named = re.search(r"`(\w+)(?::\s*([^`,]+))?`", what)
    if not named or named.group(1) not in fields:
        return len(fields), 0
    options = [str(v) for v in values.get(named.group(1), [])]
    return fields.index(named.group(1)), options.index(named.group(2)) if named.group(2) in options else -1


def _registered(what: str, values: dict[str, list[Any]]) -> bool:
    """Whether the value a row names (`field: value`) is one its field takes here, or it names none."""
    named = re.search(r"`(\w+): ([^`,]+)`", what)
    return not named or named.group(1) not in values or named.group(2) in map(str, values[named.group(1)])


def fidelity_table(rows: dict[str, dict[str, Any]]) -> str:
    """docs/model.md's fidelity table: a row per mark, schemes first, then in the order of the fields they name."""
    from posgpt.model import GPTConfig

    fields, values = [f.name for f in dataclasses.fields(GPTConfig)], field_values()
    registered = [what for what in rows if _registered(what, values)]  # a test may register more (test_extending)
    ordered = sorted(registered, key=lambda what: (*_order(what, fields, values), rows[what]["at"]))
    lines = [_row(FIDELITY_COLUMNS), _row(["---"] * len(FIDELITY_COLUMNS))]
    for what in ordered:
        row = rows[what]
        pinned = ", ".join(f"`{test}`" for test in row["pinned"])
        lines.append(_row([what, *(row[cell].replace("|", r"\|") for cell in CELLS), pinned]))
    return "\n".join(lines)


def _row(cells: Any) -> str:
    return "| " + " | ".join(cells) + " |"


def scheme_table() -> str:
    """docs/model.md's table of position schemes: each scheme's docstring, its limit and the kernel `auto` picks
    on a GPU and on a CPU (read from the declarations, as a model would choose)."""
    import torch

    from posgpt.model import ATTENTIONS, SCHEMES, GPTConfig
    from posgpt.model.masks import AttentionMask
    from posgpt.model.scores import SCORES

    lines = [_row(["`pos_encoding`", "what it does", "runs past `block_size`?", "`auto` kernel on CUDA / CPU"]),
             _row(["---"] * 4)]  # fmt: skip
    layer = ATTENTIONS["softmax"]
    for name, scheme in SCHEMES.items():
        config = GPTConfig(pos_encoding=name)
        mask, score = AttentionMask.of(config), SCORES[config.attn_score]
        chosen = [
            next(k for k, kernel in layer.kernels.items() if kernel is layer.choose_kernel("auto", needs, device))
            for device in (torch.device("cuda"), torch.device("cpu"))
            for needs in [layer.needs(scheme, mask, score, device, needs_grad=True)]
        ]
        limit = scheme.longest(config)
        past = "yes" if limit is None else "no: a clear error names the limit"
        lines.append(
            _row([f"`{name}`", _first_paragraph(scheme.__doc__).replace("|", r"\|"), past, " / ".join(chosen)])
        )
    return "\n".join(lines)


def kernel_table() -> str:
    """docs/model.md's table of kernels: each `attn_backend` name, with the docstring of the first attention
    function's kernel of that name, and the functions that have one."""
    from posgpt.model import ATTENTIONS

    lines = [_row(["`attn_backend`", "what runs", "attention functions"]), _row(["---"] * 3)]
    kernels: dict[str, tuple[Any, list[str]]] = {}
    for function, layer in ATTENTIONS.items():
        for name, kernel in layer.kernels.items():
            kernels.setdefault(name, (kernel, []))[1].append(function)
    for name, (kernel, functions) in kernels.items():
        lines.append(_row([f"`{name}`", _first_paragraph(type(kernel).__doc__), ", ".join(functions)]))
    auto = "the fastest kernel of the attention function that runs its scheme, mask, score, dropout and device"
    return "\n".join(
        [*lines, _row(["`auto`", auto + " (`rank`, `model/kernels/base.py`); never flex on a CPU", "all"])]
    )


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def names_docstrings() -> dict[tuple[str, str, str], str]:
    """The docstring of each field whose values are a registry's keys: (file, class, field) -> its text."""
    from posgpt.data.tasks import TASKS
    from posgpt.model import ATTENTIONS, SCHEMES
    from posgpt.model.attention import QK_NORMS
    from posgpt.model.scores import SCORES

    kernels: dict[str, list[str]] = {}  # the functions that share a registry of kernels, by its names
    for function, layer in ATTENTIONS.items():
        kernels.setdefault(" | ".join(layer.kernels), []).append(function)
    per_function = "; ".join(f"{', '.join(functions)}: {names}" for names, functions in kernels.items())
    model = ("model/config.py", "GPTConfig")
    return {
        (*model, "pos_encoding"): f"Position scheme (model.positions.SCHEMES; docs/model.md): {' | '.join(SCHEMES)}.",
        (*model, "attention"): "Attention function (model.attention.ATTENTIONS; docs/model.md): "
        f"{' | '.join(ATTENTIONS)}.",
        (*model, "attn_score"): f"Scoring function (model.scores.SCORES; docs/model.md): {' | '.join(SCORES)}.",
        (*model, "attn_backend"): f"Attention kernel: auto (the fastest that runs the model), or one of its attention "
        f"function's ({per_function}).",
        (*model, "qk_norm"): f"RMS-normalise each head's queries and keys (model.attention.QK_NORMS; docs/model.md): "
        f"{' | '.join(QK_NORMS)}.",
        ("data/tasks.py", "TaskConfig", "name"): f"A key of `TASKS` (docs/synthetic.md): {' | '.join(TASKS)}.",
    }  # fmt: skip


def with_docstrings(source: str, owner: str, texts: dict[str, str]) -> str:
    """`source` with the docstring under each field of class `owner` in `texts` replaced by its text, wrapped."""
    lines = source.splitlines(keepends=True)
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == owner).body
    spans = {field.target.id: (doc.lineno, doc.end_lineno) for field, doc in zip(body, body[1:], strict=False)
             if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr)}  # fmt: skip
    for name in sorted(texts, key=lambda n: spans[n], reverse=True):
        start, end = spans[name]
        wrapped = textwrap.wrap(f'"""{texts[name]}"""', 116, break_long_words=False, break_on_hyphens=False)
        lines[start - 1 : end] = [f"    {line}\n" for line in wrapped]
    return "".join(lines)


def with_summaries(source: str, summaries: dict[str, str]) -> str:
    """`source` (posgpt/cli.py or benchmarks/modes.py) with each `Lazy` mode's summary the command's own."""
    tree, lines = ast.parse(source), source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Lazy":
            module, summary = node.args[:2]
            attribute = node.args[2].value if len(node.args) == 3 else "COMMAND"
            expected = summaries[module.value if attribute == "COMMAND" else f"{module.value}:{attribute}"]
            if summary.value != expected:
                edits.append((summary, expected))
    for node, text in sorted(edits, key=lambda edit: (edit[0].lineno, edit[0].col_offset), reverse=True):
        head, tail = lines[node.lineno - 1][: node.col_offset], lines[node.end_lineno - 1][node.end_col_offset :]
        lines[node.lineno - 1 : node.end_lineno] = [head + repr(text) + tail]
    return "".join(lines)


def summaries() -> dict[str, str]:
    """Each lazy mode's summary, from its command (`module`, or `module:attribute` for another attribute)."""
    import posgpt.benchmarks.modes as bench
    import posgpt.cli as cli
    from posgpt.core.modes import Lazy, mode_summary

    found: dict[str, str] = {}
    for modes in (cli.MODES, cli.MODES["study"], bench.MODES):
        for mode in modes.values():
            if isinstance(mode, Lazy):
                summary = mode_summary(mode.load())
                found[mode.module if mode.attribute == "COMMAND" else f"{mode.module}:{mode.attribute}"] = summary
    return found


def written() -> dict[Path, str]:
    """Each file this script writes, as it should read."""
    model_doc = ROOT / "docs" / "model.md"
    files = {model_doc: model_doc.read_text()}
    files[model_doc] = _between(files[model_doc], "schemes", scheme_table())
    files[model_doc] = _between(files[model_doc], "fidelity", fidelity_table(fidelity_marks()))
    files[model_doc] = _between(files[model_doc], "kernels", kernel_table())
    for (file, owner, field), text in names_docstrings().items():
        path = ROOT / file
        files[path] = with_docstrings(files.get(path, path.read_text()), owner, {field: text})
    for path in (ROOT / "posgpt" / "cli.py", ROOT / "benchmarks" / "modes.py"):
        files[path] = with_summaries(path.read_text(), summaries())
    return files


def _between(text: str, name: str, table: str) -> str:
    """`text` with the lines between its markers `<!-- name: ... -->` and `<!-- /name -->` replaced by `table`."""
    begin = re.search(rf"<!-- {name}: [^>]*-->\n", text)
    end = text.find(f"<!-- /{name} -->")
    if not begin or end < begin.end():
        raise ValueError(f"docs/model.md has no <!-- {name}: ... --> ... <!-- /{name} --> markers")
    return text[: begin.end()] + table + "\n" + text[end:]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for path, text in written().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
