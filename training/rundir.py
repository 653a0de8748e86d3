"""The run directory: where a run may start or resume, and its config.yaml (what the run used) and requested.yaml."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import yaml

from core.errors import UserError
from core.files import atomic_write_bytes, remove_stale_tmp
from data.corpora import AUTO as AUTO_CORPUS
from training.checkpoint import same_run_differences
from training.config import RunConfig

log = logging.getLogger(__name__)


class RunError(UserError, ValueError):
    """A problem with the run directory or the run's options; the message says how to fix it."""


def resume_path(resume: str | None, run_dir: Path) -> Path | None:
    """'auto' -> <run_dir>/last.ckpt if present; a path -> that path (which must exist)."""
    if not resume:
        return None
    if resume == "auto":
        last = run_dir / "last.ckpt"
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise RunError(f"--train.resume {resume}: no such checkpoint. Pass an existing .ckpt file or 'auto'.")
    return path


CONFIG_FILE, REQUESTED_FILE = "config.yaml", "requested.yaml"


def claim_run_dir(run_dir: Path, resume: Path | None, overwrite: bool, used: RunConfig) -> None:
    """Refuse to start a fresh run in a directory that holds checkpoints or another run's config.yaml (unless
    `overwrite`: they go), and remove what killed writers left there. Call it holding the lock."""
    named = [run_dir / name for name in ("last.ckpt", "best.ckpt") if (run_dir / name).is_file()]
    existing = named + sorted(run_dir.glob("step-*.ckpt"))
    if resume is None and not overwrite:
        other = other_run(run_dir / CONFIG_FILE, used)
        held = ", ".join(p.name for p in existing[:3])
        if existing and other:  # another data, model or seed than config.yaml's: a resume is not what fits
            raise RunError(
                f"{run_dir} already holds {held} of another run ({other}): pass another --train.run_name, or "
                "--train.overwrite true (deletes them)."
            )
        if existing:
            raise RunError(
                f"{run_dir} already holds {held} from an earlier run. Resume it with --train.resume auto, or pass "
                "--train.overwrite true (deletes them) or another --train.run_name."
            )
        if other:
            raise RunError(
                f"{run_dir} holds the {CONFIG_FILE} of another run ({other}) and no checkpoint: pass the options of "
                "that run, or --train.overwrite true (starts afresh there) or another --train.run_name."
            )
    if resume is None and existing:
        for path in existing:
            path.unlink()
        log.info("--train.overwrite: removed %s", ", ".join(str(p) for p in existing))
    for path in remove_stale_tmp(run_dir):
        log.info("Removed %s, left by a run that was killed while writing it", path)


COMPARED_DATA_FIELDS = ("input", "dir", "tokenizer", "glob", "text_column", "val_fraction")  # another run's data


def other_run(path: Path, used: RunConfig) -> str:
    """How the run whose config is `path` differs from `used` in data, model or seed; '' for the same run (or none)."""
    try:
        saved = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return ""
    if not isinstance(saved, dict) or not {"model", "data", "train"} <= saved.keys():
        return ""
    now = dataclasses.asdict(used.data)
    diffs = [f"data.{k}: {saved['data'].get(k)!r} vs now {now[k]!r}"
             for k in COMPARED_DATA_FIELDS if saved["data"].get(k) not in (now[k], AUTO_CORPUS)]  # fmt: skip
    return "; ".join(diffs + same_run_differences(saved, used, CONFIG_FILE))


def used_config(cfg: RunConfig, sources: list[str], precision: str) -> RunConfig:
    """`cfg` with the corpus `auto` chose (of the prepared data's `sources`) and the precision `auto` resolved to."""
    chosen = str(sources[0]) if cfg.data.input == AUTO_CORPUS and len(sources) == 1 else cfg.data.input
    data = dataclasses.replace(cfg.data, input=chosen)
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, precision=precision))


def check_writable(path: Path, option: str) -> None:
    """Stop, before any work is done, when `path` cannot be created or written; creates nothing."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise RunError(f"Cannot create {path}: {existing} is a file. Pass {option} DIR, a directory.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunError(f"Cannot write to {path}: {existing} is read-only. Pass {option} DIR that you can write.")


def write_configs(run_dir: Path, requested: RunConfig, used: RunConfig) -> None:
    """config.yaml: what the run used (what `auto` chose); requested.yaml: the options as given."""
    for name, cfg in ((CONFIG_FILE, used), (REQUESTED_FILE, requested)):
        atomic_write_bytes(run_dir / name, yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False).encode())
