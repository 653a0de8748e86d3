"""What a resumed run may change, and the check that refuses the rest. A resume restores weights, optimizer
moments, the LR schedule's step, the data stream's position and the random state. Of the new settings, the model
may change only `CHANGEABLE_MODEL_FIELDS`; the prepared data (its fingerprint) and `train.seed` must stay; every
optim field applies from the resumed step on (the LR schedule to the scheduler, betas and weight decay to the
optimizer, grad_clip to the clipping), and so does every other train field (batch_size and grad_accum too)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from core.checkpoint import CheckpointError
from model import GPTConfig
from training.config import RunConfig, lr_factor

CHANGEABLE_MODEL_FIELDS = frozenset(
    {"attn_backend", "dropout", "rope_scaling", "rope_scaling_factor", "chunked_loss", "init_from"}
)
"""Model fields a resume may change: the weights keep their shapes and meaning (RoPE scaling: fine-tuning longer)."""


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
    """The learning rate at optimizer step `step` of a config's optim and train sections."""
    decay_steps = optim.get("decay_steps") or train["max_steps"]
    return optim["lr"] * lr_factor(step, optim["lr"], optim["min_lr"], optim["warmup_steps"], decay_steps)


def same_run_differences(saved: dict[str, Any], config: RunConfig, what: str) -> list[str]:
    """What makes `config` another run than the `saved` one (`what`: a checkpoint or config.yaml): model and seed."""
    saved_model = GPTConfig.from_dict(saved["model"])
    diffs = [
        f"model.{k}: {what} {v!r} vs now {getattr(config.model, k)!r}"
        for k, v in saved_model.to_dict().items()
        if k not in CHANGEABLE_MODEL_FIELDS and getattr(config.model, k) != v
    ]
    if saved["train"].get("seed") != config.train.seed:
        diffs.append(f"train.seed: {what} {saved['train'].get('seed')!r} vs now {config.train.seed!r}")
    return diffs
