"""What the one-command experiments share: named model variants, one run per model and seed under
<out_dir>/runs, reuse of finished runs and resumption of interrupted ones, and parsing."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from core.checkpoint import CheckpointError, read_checkpoint
from data.errors import DataError
from training.config import RunConfig
from training.run import TrainingData, train

log = logging.getLogger(__name__)

TRAIN_FIELDS = ("random_positions",)
"""Variant fields that set the training run (train.*) rather than the model."""


@dataclass
class Variant:
    """A model beside the plain schemes: a name and the settings that make it (say, RoPE with a
    sliding window, or trained on randomized positions); every other setting is the shared run's."""

    name: str
    """Label in the report and name of its runs (<name>-seed<S>)."""
    pos_encoding: str = "rope"
    """Position scheme."""
    attn_window: int = 0
    """Sliding window of W keys (0: full causal)."""
    attn_sinks: int = 0
    """Sink keys visible beyond the window."""
    attention: str = "softmax"
    """softmax or linear."""
    attn_score: str = "scaled_dot"
    """scaled_dot, dot or additive."""
    random_positions: int | None = None
    """Train on randomized positions from [0, N) (train.random_positions; None: the shared run's)."""

    def fields(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
        return {k: v for k, v in values.items() if not (k in TRAIN_FIELDS and v is None)}


def models_of(schemes: list[str], variants: list[Variant | dict]) -> list[tuple[str, dict[str, Any]]]:
    """(label, settings) of every model: each scheme as it is, then the variants."""
    named = [Variant(**v) if isinstance(v, dict) else v for v in variants]
    return [(s, {"pos_encoding": s}) for s in schemes] + [(v.name, v.fields()) for v in named]


def check_models(models: list[tuple[str, dict[str, Any]]], seeds: list[int], run: RunConfig) -> None:
    """Refuse, before any training, an empty or repeating experiment and a model whose run config is
    invalid (say, learned positions with randomized positions beyond block_size)."""
    if not models or not seeds:
        raise ValueError("An experiment needs at least one scheme or variant, and one seed.")
    names = [name for name, _ in models]
    if len(set(names)) != len(names) or len(set(seeds)) != len(seeds):
        raise ValueError(f"schemes, variant names and seeds must not repeat: {names}, {seeds}.")
    for label, settings in models:
        try:
            run_config_for(run, ".", label, settings, seeds[0])
        except ValueError as error:
            raise ValueError(f"{label}: {error}") from None


def run_config_for(run: RunConfig, out_dir: str, label: str, settings: dict[str, Any], seed: int) -> RunConfig:
    """The shared run with this model and seed, trained under <out_dir>/runs/<label>-seed<seed>."""
    model = {k: v for k, v in settings.items() if k not in TRAIN_FIELDS}
    train_fields = {k: v for k, v in settings.items() if k in TRAIN_FIELDS}
    return dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, **model),
        train=dataclasses.replace(
            run.train,
            **train_fields,
            seed=seed,
            out_dir=str(Path(out_dir) / "runs"),
            run_name=f"{label}-seed{seed}",
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
    models: list[tuple[str, dict[str, Any]]],
    seeds: list[int],
    data_for: Callable[[RunConfig], TrainingData] | None = None,
) -> tuple[list[TrainedRun], dict[str, float]]:
    """Train every model with every seed (seeds outer, so that a partial experiment has whole seeds),
    reusing runs trained to max_steps and resuming interrupted ones; `data_for` gives a run's data
    (default: the run's corpus). Returns the runs and the training wall time of those trained now."""
    trained, wall = [], {}
    for seed in seeds:
        for label, settings in models:
            run_cfg = run_config_for(run, out_dir, label, settings, seed)
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
            trained.append(TrainedRun(label, seed, str(ckpt)))
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


def build_parser(config_class: type, prog: str, description: str) -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of options (see configs/).")
    parser.add_class_arguments(config_class, None)
    for action in parser._actions:  # the tokenizer's, set from the data: not offered (older experiment.yaml
        if action.dest == "run.model.vocab_size":  # files that record it still load)
            action.help = argparse.SUPPRESS
    return parser


def parse_config(config_class: type, parser: ArgumentParser, argv: list[str] | None) -> Any:
    """The experiment the command line describes (validated: a mistake raises ValueError)."""
    config = parser.instantiate(parser.parse_args(argv))
    return config_class(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config_class)})


def main_of(
    parse: Callable[[list[str] | None], Any], run: Callable[[Any], dict[str, Any]], argv: list[str] | None
) -> None:
    """An experiment's command line: parse, run, print the table and where the report is; a mistake
    a user can fix ends in one `error:` line."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = parse(argv)
        doc = run(cfg)
    except (ValueError, DataError, CheckpointError) as error:
        sys.exit(f"error: {error}")
    out = Path(cfg.out_dir)
    print((out / "results.md").read_text())
    wall = doc["experiment"]
    print(f"report in {out} (training {sum(wall['train_wall_s'].values()):.0f} s, evaluation "
          f"{wall['eval_wall_s']:.0f} s, total {wall['total_wall_s']:.0f} s)")  # fmt: skip
