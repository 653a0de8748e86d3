"""Perplexity against context length: `python evaluate.py --ckpt A.ckpt [B.ckpt ...] --eval.lengths 128 4096`.

Scores every checkpoint at every length on the same text, with the same number of scored tokens
per length, and writes results.json, results.md, ppl_vs_length.png and loss_by_position.png to
--out. The text is each checkpoint's own validation split unless --eval_data.input FILE (tokenized
with each checkpoint's own tokenizer) or --eval_data.dir PREPARED is given. The options are the
`eval:` and `eval_data:` sections of an experiment config (`experiments.extrapolation`), under the
same names, so those sections work unchanged in a `--config` file. The logic is in `evaluation/`.
"""

from __future__ import annotations

from core.cli import Command, run
from core.errors import UserError
from evaluation.config import EvaluateConfig, check_output_dir
from evaluation.report import write_report
from evaluation.run import Subject, default_labels, evaluate_checkpoints


def main(cfg: EvaluateConfig) -> None:
    """Evaluate, write the report, print its table and where it is."""
    check_output_dir(cfg.out)
    labels = cfg.labels or default_labels(cfg.ckpt)
    subjects = [Subject(path, label) for path, label in zip(cfg.ckpt, labels, strict=True)]
    doc = evaluate_checkpoints(subjects, cfg.eval, cfg.eval_data)
    try:
        paths = write_report(doc, cfg.out)
    except OSError as error:
        raise UserError(f"cannot write the results to {cfg.out}: {error.strerror or error}.") from error
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))


COMMAND = Command("evaluate.py", EvaluateConfig, main, __doc__.splitlines()[0])

if __name__ == "__main__":
    run(COMMAND)
