"""Perplexity against context length: `python evaluate.py --ckpt A.ckpt [B.ckpt ...] --eval.lengths [128,4096]`.

Scores every checkpoint at every length on the same text, with the same number of scored tokens
per length, and writes results.json, results.md, ppl_vs_length.png and loss_by_position.png to
--out. The text is each checkpoint's own validation split unless --eval_data.input FILE (tokenized
with each checkpoint's own tokenizer) or --eval_data.dir PREPARED is given. The options are the
`eval:` and `eval_data:` sections of an experiment config (`experiments.extrapolation`), under the
same names, so those sections work unchanged in a `--config` file. The logic is in `evaluation/`.
"""

from __future__ import annotations

import logging
import sys

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from core.checkpoint import CheckpointError
from core.device import DeviceError
from data.errors import DataError
from evaluation.config import EvalData, EvalSettings, check_output_dir
from evaluation.report import write_report
from evaluation.run import Subject, default_labels, evaluate_checkpoints


def build_parser() -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help text
    p = ArgumentParser(prog="evaluate.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", action=ActionConfigFile, help="A YAML file of these options.")
    p.add_argument("--ckpt", nargs="+", required=True, help="checkpoints written by train.py")
    p.add_argument("--labels", nargs="+", help="a name per checkpoint (default: its run directory); "
                   "checkpoints sharing a name are seeds of one model: mean ± std")  # fmt: skip
    p.add_argument("--out", default="eval", help="directory for the results (created if needed)")
    p.add_class_arguments(EvalSettings, "eval")
    p.add_class_arguments(EvalData, "eval_data")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = parser.instantiate(args)  # the settings' own checks
        labels = config.labels or default_labels(config.ckpt)
        if len(labels) != len(config.ckpt):
            raise ValueError(f"--labels gives {len(labels)} names for {len(config.ckpt)} checkpoints.")
        check_output_dir(config.out)
    except ValueError as error:
        sys.exit(f"error: {error}")
    try:
        subjects = [Subject(path, label) for path, label in zip(config.ckpt, labels, strict=True)]
        doc = evaluate_checkpoints(subjects, config.eval, config.eval_data)
        paths = write_report(doc, config.out)
    except (DataError, CheckpointError, DeviceError) as error:  # problems a user can fix: each says how
        sys.exit(f"error: {error}")
    except OSError as error:
        sys.exit(f"error: cannot write the results to {args.out}: {error.strerror or error}.")
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
