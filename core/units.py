"""Counts and durations as people read them in progress lines and reports."""

from __future__ import annotations


def format_seconds(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def format_count(n: float) -> str:
    """18600 -> 18.6k, 2.3e6 -> 2.3M: rates as people read them."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"


def progress_line(step: int, total: int, parts: list[str], eta: float | None, unit: str = "step") -> str:
    """`step k/n | part | part | ETA m:ss`: every plain progress line (a run's steps, a study's runs: `unit` "run")."""
    eta_part = [f"ETA {format_seconds(eta)}"] if eta is not None else []
    return " | ".join([f"{unit} {step}/{total}", *parts, *eta_part])
