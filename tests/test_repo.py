"""The README's test command is the one CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    command = next(line for line in reversed(ci_lines) if line)  # the script's last command
    assert "ruff check" in command and "pytest" in command
    readme_lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    assert command in readme_lines
