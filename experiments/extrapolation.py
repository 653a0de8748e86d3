"""Train short, test long, in one command: one model per position scheme, then the evaluation.

    python -m experiments.extrapolation --config configs/extrapolation_shakespeare.yaml

Trains one model per scheme in `schemes` (and per named attention variant in `variants`, such as
RoPE with a sliding window) and per seed in `seeds`, identical otherwise (same data, steps, batch,
size, seed), then evaluates every final checkpoint with `evaluation` at every length and writes
one report directory:

    <out_dir>/results.md, results.json, ppl_vs_length.png, loss_by_position.png
    <out_dir>/experiment.yaml     the resolved experiment config
    <out_dir>/runs/<scheme or variant>-seed<S>/  each run's checkpoints, config.yaml and logs

Runs already trained to `max_steps` are reused, and an interrupted one resumes from its last.ckpt,
so re-running the command after a crash (or with new evaluation settings) only does what is left.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from core.checkpoint import CheckpointError, read_checkpoint
from data.errors import DataError
from evaluation.config import EvalData, EvalSettings
from evaluation.report import write_report
from evaluation.run import Subject, evaluate_checkpoints
from model.config import POS_ENCODINGS, Attention, AttnScore, PosEncoding
from training.config import RunConfig
from training.run import train

log = logging.getLogger(__name__)


@dataclass
class Variant:
    """A model beside the plain schemes: a name and the attention settings that make it (say, RoPE
    with a sliding window); every other setting is the shared run's."""

    name: str
    """Label in the report and name of its runs (<name>-seed<S>)."""
    pos_encoding: PosEncoding = "rope"
    """Position scheme."""
    attn_window: int = 0
    """Sliding window of W keys (0: full causal)."""
    attn_sinks: int = 0
    """Sink keys visible beyond the window."""
    attention: Attention = "softmax"
    """softmax or linear."""
    attn_score: AttnScore = "scaled_dot"
    """scaled_dot, dot or additive."""

    def model_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}


@dataclass
class ExperimentConfig:
    """A length-extrapolation experiment: the runs to train and how to evaluate them."""

    out_dir: str = "reports/extrapolation"
    """Report directory; the runs are trained under <out_dir>/runs."""
    schemes: list[PosEncoding] = field(default_factory=lambda: list(POS_ENCODINGS))
    """Position schemes to train, one model each (per seed)."""
    variants: list[Variant] = field(default_factory=list)
    """Further models, each a named set of attention settings (e.g. {name: rope-window64, pos_encoding:
    rope, attn_window: 64}); trained and evaluated like the schemes."""
    seeds: list[int] = field(default_factory=lambda: [1337])
    """Training seeds; with several, the table shows mean ± std across seeds."""
    run: RunConfig = field(default_factory=RunConfig)
    """The training run shared by every scheme (model.pos_encoding and train.seed are set per run)."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    """The evaluation of every final checkpoint."""
    eval_data: EvalData = field(default_factory=EvalData)
    """Evaluation text (default: the validation split of the training data)."""

    def __post_init__(self) -> None:
        if not (self.schemes or self.variants) or not self.seeds:
            raise ValueError("An experiment needs at least one scheme or variant, and one seed.")
        names = [name for name, _ in self.models()]
        if len(set(names)) != len(names) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"schemes, variant names and seeds must not repeat: {names}, {self.seeds}.")

    def models(self) -> list[tuple[str, dict[str, Any]]]:
        """(label, model fields) of every model: each scheme as it is, then the variants."""
        variants = [Variant(**v) if isinstance(v, dict) else v for v in self.variants]
        return [(s, {"pos_encoding": s}) for s in self.schemes] + [(v.name, v.model_fields()) for v in variants]


def run_config_for(cfg: ExperimentConfig, label: str, model_fields: dict[str, Any], seed: int) -> RunConfig:
    """The shared run with this model and seed, trained under <out_dir>/runs/<label>-seed<seed>."""
    run = cfg.run
    return dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, **model_fields),
        train=dataclasses.replace(
            run.train,
            seed=seed,
            out_dir=str(Path(cfg.out_dir) / "runs"),
            run_name=f"{label}-seed{seed}",
            resume="auto",
        ),
    )


def finished(ckpt: Path, max_steps: int) -> bool:
    """Whether `ckpt` exists and was written at (or after) `max_steps` optimizer steps."""
    return ckpt.is_file() and int(read_checkpoint(ckpt).get("global_step", 0)) >= max_steps


def run_experiment(cfg: ExperimentConfig) -> dict[str, Any]:
    """Train what is not trained yet, evaluate everything, write the report; returns its document."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    subjects, train_wall = [], {}
    started = time.perf_counter()
    models = cfg.models()
    for seed in cfg.seeds:
        for label, model_fields in models:
            run_cfg = run_config_for(cfg, label, model_fields, seed)
            ckpt = Path(run_cfg.train.out_dir) / run_cfg.train.run_name / "last.ckpt"
            if finished(ckpt, run_cfg.train.max_steps):
                log.info("%s: trained already (%s), reused", run_cfg.train.run_name, ckpt)
            else:
                log.info("training %s (%d of %d)", run_cfg.train.run_name, len(subjects) + 1,
                         len(cfg.seeds) * len(models))  # fmt: skip
                t0 = time.perf_counter()
                try:
                    result = train(run_cfg)
                except CheckpointError as error:
                    raise CheckpointError(f"{error} (runs are reused from {out / 'runs'}; choose another out_dir "
                                          "to start afresh)") from None  # fmt: skip
                train_wall[run_cfg.train.run_name] = round(time.perf_counter() - t0, 1)
                ckpt = result.last_ckpt
            subjects.append(Subject(str(ckpt), label=label))
    t0 = time.perf_counter()
    doc = evaluate_checkpoints(subjects, cfg.eval, cfg.eval_data)
    doc["experiment"] = {
        "config": dataclasses.asdict(cfg),
        "train_wall_s": train_wall,
        "eval_wall_s": round(time.perf_counter() - t0, 1),
        "total_wall_s": round(time.perf_counter() - started, 1),
    }
    write_report(doc, out)
    return doc


def build_parser() -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(
        prog="python -m experiments.extrapolation",
        description="Train one model per position scheme, evaluate them all at every length, write a report.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of options (see configs/).")
    parser.add_class_arguments(ExperimentConfig, None)
    for action in parser._actions:  # the tokenizer's, set from the data: not offered (older experiment.yaml
        if action.dest == "run.model.vocab_size":  # files that record it still load)
            action.help = argparse.SUPPRESS
    return parser


def parse_config(argv: list[str] | None = None) -> ExperimentConfig:
    """The experiment the command line describes (validated: a mistake raises ValueError)."""
    parser = build_parser()
    config = parser.instantiate(parser.parse_args(argv))
    return ExperimentConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ExperimentConfig)})


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = parse_config(argv)
        doc = run_experiment(cfg)
    except (ValueError, DataError, CheckpointError) as error:
        sys.exit(f"error: {error}")
    out = Path(cfg.out_dir)
    print((out / "results.md").read_text())
    wall = doc["experiment"]
    trained = sum(wall["train_wall_s"].values())
    print(f"report in {out} (training {trained:.0f} s, evaluation {wall['eval_wall_s']:.0f} s, "
          f"total {wall['total_wall_s']:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
