"""Train short, test long, in one command: one model per position scheme, then the evaluation.

    python -m experiments.extrapolation --config configs/extrapolation_shakespeare.yaml

Trains one model per scheme in `schemes` (and per named variant in `variants`: a name and overrides
of the shared run's `model:` and `train:` sections, such as RoPE with a sliding window) and per seed
in `seeds`, identical otherwise (same data, steps, batch, size, seed), then evaluates every final
checkpoint with `evaluation` at every length and writes one report directory:

    <out_dir>/results.md, results.json, ppl_vs_length.png, loss_by_position.png
    <out_dir>/experiment.yaml     the resolved experiment config
    <out_dir>/runs/<scheme or variant>-seed<S>/  each run's checkpoints, config.yaml and logs

Runs already trained to `max_steps` are reused, and an interrupted one resumes from its last.ckpt,
so re-running the command after a crash (or with new evaluation settings) only does what is left.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core.cli import run
from evaluation.config import EvalData, EvalSettings
from evaluation.run import Subject, evaluate_checkpoints, merge_documents
from experiments.common import (
    Variant,
    check_models,
    evaluate_each,
    experiment_command,
    experiment_record,
    models_of,
    print_report,
    train_all,
)
from experiments.plan import Deadline
from model import POS_ENCODINGS
from training.config import RunConfig

log = logging.getLogger(__name__)

QUICK_CONFIG = "configs/extrapolation_quick.yaml"
"""The study a newcomer runs first: three schemes in about 5 minutes on a 2-core CPU (the README's table)."""


@dataclass
class ExperimentConfig:
    """A length-extrapolation experiment: the runs to train and how to evaluate them."""

    out_dir: str = "reports/extrapolation"
    """Report directory; the runs are trained under <out_dir>/runs."""
    schemes: list[str] = field(default_factory=lambda: list(POS_ENCODINGS))
    """Position schemes to train, one model each (per seed)."""
    variants: list[Variant] = field(default_factory=list)
    """Further models, each a name and its overrides of the shared run's model and train sections (e.g.
    {name: rope-window64, model: {pos_encoding: rope, attn_window: 64}}); trained and evaluated like the
    schemes."""
    seeds: list[int] = field(default_factory=lambda: [1337])
    """Training seeds; with several, the table shows mean ± std across seeds."""
    run: RunConfig = field(default_factory=RunConfig)
    """The training run shared by every scheme (model.pos_encoding and train.seed are set per run)."""
    eval: EvalSettings = field(default_factory=lambda: EvalSettings(attention_stats=True))
    """The evaluation of every final checkpoint; here with the attention statistics (entropy, sink mass,
    sink rate) beside the perplexity by default."""
    eval_data: EvalData = field(default_factory=EvalData)
    """Evaluation text (default: the validation split of the training data)."""
    max_minutes: float = 0.0
    """End this command cleanly within this many minutes (0: no limit): the run in progress saves its last.ckpt,
    evaluations done are kept, and the command exits with status 75; the same command continues the study."""

    def __post_init__(self) -> None:
        check_models(self.models(), self.seeds, self.run)

    def models(self) -> list[Variant]:
        """Every model: each scheme as it is, then the variants."""
        return models_of(self.schemes, self.variants)


def run_experiment(cfg: ExperimentConfig) -> dict[str, Any]:
    """Train what is not trained yet, evaluate everything, write the report and print its table;
    returns its document."""
    from evaluation.report import write_report  # matplotlib: imported to draw, not for the command's --help

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    started, deadline = time.perf_counter(), Deadline(cfg.max_minutes)
    trained, train_wall = train_all(cfg.run, cfg.out_dir, cfg.models(), cfg.seeds, max_minutes=cfg.max_minutes,
                                    deadline=deadline, shorter=QUICK_CONFIG)  # fmt: skip
    key = {"eval": dataclasses.asdict(cfg.eval), "eval_data": dataclasses.asdict(cfg.eval_data)}
    docs, eval_wall = evaluate_each(
        trained,
        "extrapolation",
        key,
        lambda r: evaluate_checkpoints([Subject(r.ckpt, r.label)], cfg.eval, cfg.eval_data),
        deadline,
        cfg.max_minutes,
    )
    doc = merge_documents(docs)
    doc["experiment"] = experiment_record(cfg, trained, train_wall, eval_wall, started)
    write_report(doc, out)
    print_report(cfg.out_dir, doc)
    return doc


COMMAND = experiment_command(
    "python -m experiments.extrapolation",
    ExperimentConfig,
    run_experiment,
    "Train one model per position scheme, evaluate them all at every length, write a report.",
)

if __name__ == "__main__":
    run(COMMAND)
