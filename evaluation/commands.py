"""The command lines of sample.py, evaluate.py and attention_maps.py (`posgpt sample | evaluate | attention`):
each parses its options, runs the function in evaluation/ and says what it wrote."""

from __future__ import annotations

import os
import sys

from core.cli import Command
from core.errors import UserError
from evaluation.attention_maps import MapsConfig
from evaluation.attention_maps import run as draw
from evaluation.config import EvaluateConfig, check_output_dir
from evaluation.run import Subject, default_labels, evaluate_checkpoints
from evaluation.sampling import SampleConfig, sample


def sample_main(cfg: SampleConfig) -> None:
    """Sample; a reader that closes the pipe (`... | head`) has what it wanted, which is no error."""
    try:
        sample(cfg)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush into the pipe


def evaluate_main(cfg: EvaluateConfig) -> None:
    """Evaluate, write the report, print its table and where it is."""
    from evaluation.report import write_report  # matplotlib: imported to draw, not for --help

    check_output_dir(cfg.out)
    subjects = [Subject(p, label) for p, label in zip(cfg.ckpt, cfg.labels or default_labels(cfg.ckpt), strict=True)]
    doc = evaluate_checkpoints(subjects, cfg.eval, cfg.eval_data)
    try:
        paths = write_report(doc, cfg.out)
    except OSError as error:
        raise UserError(f"cannot write the results to {cfg.out}: {error.strerror or error}.") from error
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))


def attention_main(cfg: MapsConfig) -> None:
    """Draw, write, say what was written."""
    try:
        paths = draw(cfg)
    except OSError as error:
        raise UserError(f"cannot write the figures to {cfg.out}: {error.strerror or error}.") from error
    print(f"wrote {len(paths)} files to {cfg.out}: " + ", ".join(str(p) for p in paths[:8])
          + (" ..." if len(paths) > 8 else ""))  # fmt: skip


SAMPLE = Command(
    "sample.py",
    SampleConfig,
    sample_main,
    "Sample from a trained checkpoint: --ckpt runs/NAME/last.ckpt --prompt 'ROMEO:'. The checkpoint alone "
    "rebuilds model and tokenizer; text goes to stdout (streamed for one sample in a terminal), speed to stderr.",
    logs=False,
)

EVALUATE = Command(
    "evaluate.py",
    EvaluateConfig,
    evaluate_main,
    """Perplexity against context length: --ckpt A.ckpt [B.ckpt ...] --eval.lengths 128 4096.

Scores every checkpoint at every length on the same text, with the same number of scored tokens per length,
and writes results.json, results.md, ppl_vs_length.png and loss_by_position.png to --out. The text is each
checkpoint's own validation split unless --eval_data.input FILE (tokenized with each checkpoint's own
tokenizer) or --eval_data.dir PREPARED is given. The options are the eval: and eval_data: sections of a
study's config, under the same names.""",
)

ATTENTION = Command(
    "attention_maps.py",
    MapsConfig,
    attention_main,
    """Look inside trained models: --ckpt A.ckpt --prompt "ROMEO:" --out maps.

With --prompt (up to 64 tokens): per checkpoint, one PNG per layer with a grid of heads (query x key
heatmaps) and one of every layer averaged over heads. With --lengths 256 1024 4096: per length, attention
mass against distance, attention entropy and the mass on the first tokens against query position, per
layer, the training length marked. results.json holds every number plotted. The weights are recomputed in
float32 on the eager reference kernel from the checkpoint's parameters: the fused kernels that train and
sample never form them.""",
    aliases={"eval_data.": "data."},
)
