"""Which code produced a result: recorded in run logs and evaluation results."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_sha() -> str:
    """The short commit of this checkout, or 'unknown' outside a git checkout."""
    try:
        repo = Path(__file__).resolve().parents[1]
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
