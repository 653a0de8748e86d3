"""Train short, test long, in one command: `posgpt study extrapolation --config configs/X.yaml`.

One model per scheme in `schemes`, per variant in `variants` and per seed, identical otherwise; every final
checkpoint is evaluated at every length into one report directory (<out_dir>/results.md, results.json, the
plots, experiment.yaml, runs/). Finished runs are reused and interrupted ones resume, so running the command
again only does what is left.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from posgpt.core import cli
from posgpt.evaluation.checkpoint import EvalData
from posgpt.evaluation.run import EvalSettings, evaluate_checkpoints, merge_documents
from posgpt.experiments.common import Launch, Study, Variant, experiment_command, run_config_for, run_tokens
from posgpt.model import SCHEMES
from posgpt.training.config import RunConfig

log = logging.getLogger(__name__)

QUICK_CONFIG = "configs/extrapolation_quick.yaml"
"""The study a newcomer runs first: three schemes in about 5 minutes on a 2-core CPU (the README's table)."""


METHODS: dict[str, dict[str, Any]] = {"none": {}, "pi": {"rope_scaling": "linear"}, "ntk": {"rope_scaling": "ntk"},
                                      "yarn": {"rope_scaling": "yarn"},
                                      "drope": {"pos_encoding": "none", "attn_log_scaling": "fixed"}}  # fmt: skip
"""Each context-extension method: what it sets in the fine-tuned model (the scalings' factor is `Extension.factor`;
DroPE's is the switch of `configs/extrapolation_shakespeare.yaml`'s drope variant)."""


@dataclass
class Extension:
    """Context extension as PI, YaRN and DroPE do it: every trained model fine-tuned from its final checkpoint (fresh
    optimizer, schedule and data) at `factor` times its block_size, once per method: `none` (the length alone) for
    every model but a learned table's; `pi`, `ntk` and `yarn` (RoPE scaled by `factor` from the original length) and
    `drope` (RoPE dropped) for a model whose scheme rescales (RoPE). Each is a model of the report, named
    <model>-x<factor>-<method>, trained after every other model of its seed."""

    factor: int = 4
    methods: list[Literal["none", "pi", "ntk", "yarn", "drope"]] = field(default_factory=lambda: ["none", "pi", "yarn"])
    train: dict[str, Any] = field(default_factory=lambda: {"max_steps": 100, "eval_interval": 100})
    """Fields of the shared run's training that the fine-tunes set otherwise (max_steps, batch_size, ...); a model's
    own (a switch, random positions) are not repeated."""
    optim: dict[str, Any] = field(default_factory=dict)
    """Fields of the shared run's optimizer that the fine-tunes set otherwise (lr, warmup_steps, ...)."""

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 2 or not self.methods:
            raise ValueError(f"extend needs a whole factor >= 2 and a method, got {self.factor!r}, {self.methods}.")

    def variants(self, trained: list[Variant], run: RunConfig) -> list[Variant]:
        """The fine-tunes of the `trained` models (each from the model it ends as, after a `train.switch_at`); one
        the config classes refuse (DroPE beside Llama 4's QK-norm, say) is left out, with a line that says so."""
        out, train = [], {"switch_at": 0.0, "switch_model": {}, **self.train}
        for model in trained:
            try:
                config = run_config_for(run, ".", model, 0).switched_model()
            except (TypeError, ValueError):  # its own check says why, naming it
                continue
            scheme, was = SCHEMES[config.pos_encoding], config.to_dict()
            for method in self.methods if scheme.longest(config) is None else ():  # a learned table ends at its length
                if method != "none" and not scheme.rescalable:
                    continue
                changes = {"block_size": self.factor * config.block_size, **METHODS[method]}
                if "rope_scaling" in changes:  # scaled by the factor from the length it was trained at
                    changes |= {"rope_scaling_factor": self.factor, "original_block_size": config.original_length}
                changes |= scheme.sized_settings(config)  # parameters sized by the old block_size keep their size
                name, fields = f"{model.name}-x{self.factor}-{method}", {**was, **changes}
                try:
                    run_config_for(run, ".", Variant(name, fields, train), 0)
                except (TypeError, ValueError) as error:
                    log.warning("extend: %s left out: %s", name, error)
                    continue
                out.append(Variant(name, fields, train, {**model.optim, **self.optim}, extends=model.name))
        return out


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
    extend: Extension | None = None
    """Fine-tune every trained model at a longer length with each context-extension method (null: none)."""

    def every_model(self) -> list[Variant]:
        trained = super().every_model()
        return trained + (self.extend.variants(trained, self.run) if self.extend else [])


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
