"""What tests/docs_tables.py writes from the registries, the declarations and the tests' fidelity marks (docs/model.md's
tables, the names in the config's docstrings, the commands' summaries) is as it would write it now."""

from __future__ import annotations

import docs_tables
import pytest


def test_nothing_written_from_the_registries_is_stale():
    stale = [str(path.relative_to(docs_tables.ROOT)) for path, text in docs_tables.written().items()
             if path.read_text() != text]  # fmt: skip
    assert not stale, f"{', '.join(stale)} stale: run python tests/docs_tables.py"


def test_a_fidelity_row_has_its_cells_once(tmp_path):
    (tmp_path / "test_a.py").write_text('@fidelity("`x: y`")\ndef test_one():\n    pass\n')
    with pytest.raises(ValueError, match="no test gives the cells of fidelity row '`x: y`'"):
        docs_tables.fidelity_marks(tmp_path)
    cells = ", ".join(f'{cell}="c"' for cell in docs_tables.CELLS)
    (tmp_path / "test_b.py").write_text(f'@fidelity("`x: y`", {cells})\ndef test_two():\n    pass\n')
    assert docs_tables.fidelity_marks(tmp_path)["`x: y`"]["pinned"] == [
        "tests/test_a.py::test_one",
        "tests/test_b.py::test_two",
    ]
    (tmp_path / "test_c.py").write_text(f'@fidelity("`x: y`", {cells})\ndef test_three():\n    pass\n')
    with pytest.raises(ValueError, match="given once"):
        docs_tables.fidelity_marks(tmp_path)
