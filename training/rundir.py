"""The run directory: where a run may start or resume, and its config.yaml (what the run used) and requested.yaml.

What a resumed run may change. A resume restores weights, optimizer moments, the LR schedule's step, the data
stream's position and the random state. Of the new settings, the model may change only its fields of role `RESUME`;
the prepared data (its fingerprint) and `train.seed` must stay; every optim field applies from the resumed step on
(the LR schedule to the scheduler, betas and weight decay to the optimizer, grad_clip to the clipping), and so does
every other train field (batch_size and grad_accum too)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any

import yaml

from posgpt.core.checkpoint import CheckpointError
from posgpt.core.errors import UserError
from posgpt.core.files import atomic_write_bytes, remove_stale_tmp
from posgpt.data.corpora import AUTO as AUTO_CORPUS
from posgpt.model.roles import Role
from posgpt.training.config import RunConfig, lr_factor

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


def check_resume(ckpt: dict[str, Any], path: str | Path, config: RunConfig, data: dict[str, Any]) -> list[str]:
    """Refuse to resume from `ckpt` (read from `path`) with `config` on `data` (its provenance record) when the model,
    the data or the seed differ; return the optim and train changes as "section.field: old -> new" lines."""
    saved = ckpt["hyper_parameters"]["config"]
    diffs = same_run_differences(saved, config, "checkpoint")
    if ckpt.get("switched_at") is not None and saved["train"].get("switch_model") != config.train.switch_model:
        diffs.append(
            f"train.switch_model: the checkpoint's model switched to {saved['train'].get('switch_model')!r} at step "
            f"{ckpt['switched_at']}, now {config.train.switch_model!r}"
        )
    saved_data = ckpt["hyper_parameters"].get("data")
    if saved_data and saved_data.get("fingerprint") != data.get("fingerprint"):
        diffs.append(
            f"data: checkpoint trained on {saved_data.get('prepared')}, now {data.get('prepared')} "
            "(another text or other data settings)"
        )
    if diffs:
        raise CheckpointError(
            f"Cannot resume from {path}: {'; '.join(diffs)}. A resume continues the same run; use the "
            "checkpoint's settings, or start a fresh run (another --train.run_name, or --train.overwrite true)."
        )
    now = dataclasses.asdict(config)
    changes = [
        f"{section}.{k}: {v!r} -> {now[section][k]!r}"
        for section in ("optim", "train")
        for k, v in saved[section].items()
        if k in now[section] and now[section][k] != v and k != "resume"
    ]
    step = int(ckpt.get("global_step", 0))
    before, after = learning_rate(saved["optim"], saved["train"], step), learning_rate(now["optim"], now["train"], step)
    if not math.isclose(before, after, rel_tol=0.01):  # a shorter --train.max_steps ends the cosine sooner
        changes.append(f"the learning rate at step {step}: {before:.3g} -> {after:.3g} at once (the new schedule's)")
    return changes


def learning_rate(optim: dict[str, Any], train: dict[str, Any], step: int) -> float:
    decay_steps = optim.get("decay_steps") or train["max_steps"]
    return optim["lr"] * lr_factor(step, optim["lr"], optim["min_lr"], optim["warmup_steps"], decay_steps)


def same_run_differences(saved: dict[str, Any], config: RunConfig, what: str) -> list[str]:
    """What makes `config` another run than the `saved` one (`what`: a checkpoint or config.yaml): model and seed."""
    saved_model, resumable = type(config.model).from_dict(saved["model"]), config.model.fields_with(Role.RESUME)
    diffs = [
        f"model.{k}: {what} {v!r} vs now {getattr(config.model, k)!r}"
        for k, v in saved_model.to_dict().items()
        if k not in resumable and getattr(config.model, k) != v
    ]
    if saved["train"].get("seed") != config.train.seed:
        diffs.append(f"train.seed: {what} {saved['train'].get('seed')!r} vs now {config.train.seed!r}")
    return diffs
