"""Length generalisation on a synthetic task, in one command: one model per position scheme (and
variant) and seed, trained on short inputs, tested for exact-match accuracy on long ones.

    posgpt study synthetic --config configs/synthetic_copy.yaml --schemes rope alibi --seeds 1 2

The task (`data.tasks`) and its lengths are the `task:` section. Writes <out_dir>/results.md, results.json,
accuracy_vs_length.png (and passkey_depth.png), experiment.yaml and runs/; reuses and resumes runs as
`experiments.extrapolation` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from posgpt.core.device import pick_device
from posgpt.data.tasks import TASKS, TaskConfig, eval_set, tokenizer_for
from posgpt.evaluation.checkpoint import load_checkpoint, progress_bar, results_header
from posgpt.evaluation.tasks import evaluate_task
from posgpt.experiments.common import Launch, PlannedRun, Study, experiment_command
from posgpt.training.config import RunConfig

FORMAT = "posgpt-synthetic/1"


@dataclass
class SyntheticConfig(Study):
    """A length-generalisation experiment on one synthetic task."""

    out_dir: str = "reports/synthetic"
    """Report directory; the runs are trained under <out_dir>/runs."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task, its training lengths and its test sets."""
    run: RunConfig = field(default_factory=RunConfig)
    """The run shared by every model (data from the task; model.block_size must hold its longest example)."""
    eval_batch: int = 50
    """Test examples decoded at once."""
    device: str = "auto"
    """Device of the evaluation: auto (cuda if available, else cpu), cpu, cuda, ..."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.task = self.task.resolved()  # the task's own depths written out, in every record
        longest = max(len(e.prompt) + len(e.answer) - 1 for e in eval_set(self.task, self.task.train_max, size=8))
        if longest > self.run.model.block_size:
            raise ValueError(
                f"Training examples of {self.task.name} reach {longest} tokens at task.train_max "
                f"{self.task.train_max}; raise run.model.block_size to at least {longest}."
            )


def run_synthetic(cfg: SyntheticConfig) -> dict[str, Any]:
    """Train what is not trained yet, test every model at every length, write and print the report; its document."""
    from posgpt.evaluation.task_report import write_task_report  # matplotlib and Lightning: imported to run, not for
    from posgpt.training.run import task_data  # the command's --help

    launch = Launch(cfg)
    tokenizer = tokenizer_for(cfg.task)
    trained = launch.train(lambda r: task_data(cfg.task, r), tokenizer.vocab_size)
    device = pick_device(cfg.device)
    key = {"task": asdict(cfg.task), "eval_batch": cfg.eval_batch, "device": str(device)}
    depths = len(cfg.task.depths) if TASKS[cfg.task.name].depths else 1
    per_run = len(cfg.task.eval_lengths) * depths * cfg.task.test_size
    with progress_bar(len(trained) * per_run, "example") as bar:

        def evaluate(run: PlannedRun) -> dict[str, Any]:
            bar.set_description(f"{run.label} seed {run.seed}")
            ckpt = load_checkpoint(run.ckpt)
            model = ckpt.model.to(device)
            return {
                "label": run.label,
                "seed": run.seed,
                "checkpoint": str(run.ckpt),
                "pos_encoding": model.config.pos_encoding,
                "random_positions": ckpt.config["train"].get("random_positions", 0),
                "model": model.config.to_dict(),  # the model evaluated (after a switch: the new one)
                "results": evaluate_task(model, tokenizer, cfg.task, cfg.eval_batch, bar.update),
            }

        runs = launch.evaluate("task", key, evaluate)
    doc = {"format": FORMAT, **results_header(device, torch.float32), "task": asdict(cfg.task), "runs": runs}
    return launch.finish(doc, write_task_report)


COMMAND = experiment_command(
    "posgpt study synthetic",
    SyntheticConfig,
    run_synthetic,
    "Train one model per position scheme on a synthetic task, test exact-match accuracy at every length.",
)

if __name__ == "__main__":  # `python -m` would load this module under a second name, __main__
    raise SystemExit("error: run `posgpt study synthetic` (or `python -m posgpt study synthetic`).")
