"""What the one-command experiments share: named model variants, one run per model and seed under
<out_dir>/runs, reuse of finished runs and resumption of interrupted ones, and the report's last words."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.checkpoint import CheckpointError, read_checkpoint
from core.cli import Command
from core.errors import ConfigError, did_you_mean
from training.config import RunConfig
from training.run import TrainingData, train

log = logging.getLogger(__name__)

HIDDEN = frozenset({"run.model.vocab_size"})
"""Accepted but not offered: the tokenizer's, set from the data (older experiment.yaml files record it)."""

VARIANT_FORMAT = (
    "A variant is a name and what it changes in the shared run: {name: rope-w64, model: {pos_encoding: rope, "
    "attn_window: 64}, train: {random_positions: 512}}; experiment files written before model fields went under "
    "model: and random_positions under train: need that change."
)


def experiment_command(prog: str, config: type, main: Callable[[Any], object], description: str) -> Command:
    """A study's command line: its options, what runs them, and what older files need to load."""
    return Command(prog, config, main, description, hidden=HIDDEN, hints={'Parser key "variants"': VARIANT_FORMAT})


PER_RUN = ("seed", "out_dir", "run_name", "resume")
"""train fields that the experiment sets for every run (from `seeds` and `out_dir`), never a variant."""


@dataclass
class Variant:
    """A model beside the plain schemes: a name and what it changes in the shared run, e.g.
    `{name: rope-window64, model: {pos_encoding: rope, attn_window: 64}}` or
    `{name: rope-randpos, model: {pos_encoding: rope}, train: {random_positions: 512}}`."""

    name: str
    """Label in the report and name of its runs (<name>-seed<S>)."""
    model: dict[str, Any] = field(default_factory=dict)
    """Fields of the shared run's model (run.model) that this model sets otherwise."""
    train: dict[str, Any] = field(default_factory=dict)
    """Fields of the shared run's training (run.train) that this model sets otherwise (say, random_positions)."""


def models_of(schemes: list[str], variants: list[Variant]) -> list[Variant]:
    """Every model: each scheme as it is (a variant that sets only model.pos_encoding), then the variants."""
    return [Variant(s, {"pos_encoding": s}) for s in schemes] + list(variants)


def check_models(models: list[Variant], seeds: list[int], run: RunConfig) -> None:
    """Refuse, before any training, an empty or repeating experiment and a model whose overrides the
    config classes refuse (an unknown field, an invalid value, learned positions with randomized
    positions beyond block_size), in one line that names the model."""
    if not models or not seeds:
        raise ConfigError("An experiment needs at least one scheme or variant, and one seed.")
    names = [m.name for m in models]
    if len(set(names)) != len(names) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"schemes, variant names and seeds must not repeat: {names}, {seeds}.")
    for variant in models:
        try:
            _check_fields(variant, run)
            run_config_for(run, ".", variant, seeds[0])
        except (TypeError, ValueError) as error:  # TypeError: a value of the wrong type met a check
            raise ConfigError(f"{variant.name}: {error}") from None


def _check_fields(variant: Variant, run: RunConfig) -> None:
    for section, overrides in (("model", variant.model), ("train", variant.train)):
        names = [f.name for f in dataclasses.fields(getattr(run, section)) if f.init]
        for name in overrides:
            if name not in names:
                raise ConfigError(f"{section} has no field {name!r}{did_you_mean(name, names, section + '.')}")
            if section == "train" and name in PER_RUN:
                raise ConfigError(f"train.{name} is set for every run by the experiment (seeds, out_dir).")


def run_config_for(run: RunConfig, out_dir: str, variant: Variant, seed: int) -> RunConfig:
    """The shared run with this model and seed, trained under <out_dir>/runs/<name>-seed<seed>; the
    config classes check the result as they check any config."""
    return dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, **variant.model),
        train=dataclasses.replace(
            run.train,
            **variant.train,
            seed=seed,
            out_dir=str(Path(out_dir) / "runs"),
            run_name=f"{variant.name}-seed{seed}",
            resume="auto",
        ),
    )


def finished(ckpt: Path, max_steps: int) -> bool:
    """Whether `ckpt` exists and was written at (or after) `max_steps` optimizer steps."""
    return ckpt.is_file() and int(read_checkpoint(ckpt).get("global_step", 0)) >= max_steps


@dataclass
class TrainedRun:
    label: str
    seed: int
    ckpt: str


def train_all(
    run: RunConfig,
    out_dir: str,
    models: list[Variant],
    seeds: list[int],
    data_for: Callable[[RunConfig], TrainingData] | None = None,
) -> tuple[list[TrainedRun], dict[str, float]]:
    """Train every model with every seed (seeds outer, so that a partial experiment has whole seeds),
    reusing runs trained to max_steps and resuming interrupted ones; `data_for` gives a run's data
    (default: the run's corpus). Returns the runs and the training wall time of those trained now."""
    trained, wall = [], {}
    for seed in seeds:
        for variant in models:
            run_cfg = run_config_for(run, out_dir, variant, seed)
            ckpt = Path(run_cfg.train.out_dir) / run_cfg.train.run_name / "last.ckpt"
            if finished(ckpt, run_cfg.train.max_steps):
                log.info("%s: trained already (%s), reused", run_cfg.train.run_name, ckpt)
            else:
                log.info("training %s (%d of %d)", run_cfg.train.run_name, len(trained) + 1, len(seeds) * len(models))
                t0 = time.perf_counter()
                try:
                    result = train(run_cfg, data_for(run_cfg) if data_for else None)
                except CheckpointError as error:
                    raise CheckpointError(f"{error} (runs are reused from {Path(out_dir) / 'runs'}; choose another "
                                          "out_dir to start afresh)") from None  # fmt: skip
                wall[run_cfg.train.run_name] = round(time.perf_counter() - t0, 1)
                ckpt = result.last_ckpt
            trained.append(TrainedRun(variant.name, seed, str(ckpt)))
    return trained, wall


def experiment_record(cfg: Any, train_wall: dict[str, float], eval_started: float, started: float) -> dict[str, Any]:
    """The `experiment` entry of a report: the resolved config and where the time went."""
    now = time.perf_counter()
    return {
        "config": dataclasses.asdict(cfg),
        "train_wall_s": train_wall,
        "eval_wall_s": round(now - eval_started, 1),
        "total_wall_s": round(now - started, 1),
    }


def print_report(out_dir: str, doc: dict[str, Any]) -> None:
    """The table of results.md and where the report and the time went."""
    out = Path(out_dir)
    print((out / "results.md").read_text())
    wall = doc["experiment"]
    print(f"report in {out} (training {sum(wall['train_wall_s'].values()):.0f} s, evaluation "
          f"{wall['eval_wall_s']:.0f} s, total {wall['total_wall_s']:.0f} s)")  # fmt: skip
