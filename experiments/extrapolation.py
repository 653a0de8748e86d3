"""Train short, test long, in one command: `posgpt study extrapolation --config configs/X.yaml`.

One model per scheme in `schemes`, per variant in `variants` and per seed, identical otherwise; every final
checkpoint is evaluated at every length into one report directory (<out_dir>/results.md, results.json, the
plots, experiment.yaml, runs/). Finished runs are reused and interrupted ones resume, so running the command
again only does what is left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from posgpt.core import cli
from posgpt.evaluation.checkpoint import EvalData
from posgpt.evaluation.run import EvalSettings, evaluate_checkpoints, merge_documents
from posgpt.experiments.common import Launch, Study, experiment_command, run_tokens
from posgpt.training.config import RunConfig

QUICK_CONFIG = "configs/extrapolation_quick.yaml"
"""The study a newcomer runs first: three schemes in about 5 minutes on a 2-core CPU (the README's table)."""


@dataclass
class ExperimentConfig(Study):
    """A length-extrapolation experiment: the runs to train and how to evaluate them."""

    out_dir: str = "reports/extrapolation"
    """Report directory; the runs are trained under <out_dir>/runs."""
    run: RunConfig = field(default_factory=RunConfig)
    """The training run shared by every scheme (model.pos_encoding and train.seed are set per run)."""
    eval: EvalSettings = field(default_factory=lambda: EvalSettings(attention_stats=True))
    """The evaluation of every final checkpoint, attention statistics (entropy, sink mass, sink rate) on by default."""
    eval_data: EvalData = field(default_factory=EvalData)
    """Evaluation text (default: the validation split of the training data)."""


def run_experiment(cfg: ExperimentConfig) -> dict[str, Any]:
    """Train what is not trained yet, evaluate everything, write and print the report; returns its document."""
    from posgpt.evaluation.report import write_report  # matplotlib: imported to draw, not for the command's --help

    launch = Launch(cfg)
    quick = cli.parse(COMMAND, ["--config", QUICK_CONFIG])  # what the quick study trains, to judge this plan by
    launch.train(shorter=(QUICK_CONFIG, len(quick.models()) * len(quick.seeds) * run_tokens(quick.run)))
    key = {"eval": asdict(cfg.eval), "eval_data": asdict(cfg.eval_data)}
    docs = launch.evaluate(
        "extrapolation", key, lambda r: evaluate_checkpoints([r.ckpt], [r.label], cfg.eval, cfg.eval_data)
    )
    return launch.finish(merge_documents(docs), write_report)


COMMAND = experiment_command(
    "posgpt study extrapolation",
    ExperimentConfig,
    run_experiment,
    "Train one model per position scheme, evaluate them all at every length, write a report.",
)

if __name__ == "__main__":  # `python -m` would load this module under a second name, __main__
    raise SystemExit("error: run `posgpt study extrapolation` (or `python -m posgpt study extrapolation`).")
