"""Perplexity against context length: `python evaluate.py --ckpt A.ckpt [B.ckpt ...] --lengths 128 ... 4096`.

Scores every checkpoint at every length on the same text, with the same number of scored tokens
per length, and writes results.json, results.md, ppl_vs_length.png and loss_by_position.png to
--out. The text is each checkpoint's own validation split unless --data.input FILE (tokenized with
each checkpoint's own tokenizer) or --data.dir PREPARED is given. The logic is in `evaluation/`.
"""

from __future__ import annotations

import dataclasses
import sys

from jsonargparse import ActionConfigFile, ArgumentParser

from core.checkpoint import CheckpointError
from data.errors import DataError
from evaluation.config import EvalData, EvalSettings
from evaluation.report import write_report
from evaluation.run import Subject, default_labels, evaluate_checkpoints
from model.config import ROPE_SCALINGS

DEFAULTS = EvalSettings()


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="evaluate.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", action=ActionConfigFile, help="A YAML file of these options.")
    p.add_argument("--ckpt", nargs="+", required=True, help="checkpoints written by train.py")
    p.add_argument("--labels", nargs="+", help="a name per checkpoint (default: its run directory); "
                   "checkpoints sharing a name are seeds of one model: mean ± std")  # fmt: skip
    p.add_argument("--out", default="eval", help="directory for the results (created if needed)")
    p.add_argument("--lengths", nargs="+", type=int, default=DEFAULTS.lengths, help="context lengths, in tokens")
    p.add_argument("--mode", choices=["nonoverlap", "sliding"], default=DEFAULTS.mode,
                   help="nonoverlap: every token of each window scored; sliding: the last --stride tokens")  # fmt: skip
    p.add_argument("--stride", type=int, default=None, help="tokens scored per window in sliding mode")
    p.add_argument("--token_budget", type=int, default=DEFAULTS.token_budget, help="tokens scored per length")
    p.add_argument("--rope_scaling", nargs="+", choices=list(ROPE_SCALINGS), default=DEFAULTS.rope_scaling,
                   help="for RoPE checkpoints, one evaluation per entry (none = as trained)")  # fmt: skip
    p.add_argument("--rope_scaling_factor", type=str, default=DEFAULTS.rope_scaling_factor,
                   help="a number >= 1, or dynamic: L / block_size beyond the training length")  # fmt: skip
    p.add_argument("--buckets", type=int, default=DEFAULTS.buckets, help="position buckets in the by-position loss")
    p.add_argument("--batch_tokens", type=int, default=DEFAULTS.batch_tokens, help="tokens per forward pass")
    p.add_argument("--device", default=DEFAULTS.device, help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=DEFAULTS.dtype,
                   help="autocast dtype (auto: bfloat16 on a GPU, else float32)")  # fmt: skip
    p.add_argument("--progress", type=bool, default=True, help="show a progress bar")
    p.add_class_arguments(EvalData, "data")
    return p


def parse_factor(text: str) -> float | str:
    if text == "dynamic":
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--rope_scaling_factor must be a number >= 1 or 'dynamic', got {text!r}.") from None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EvalSettings)}
        settings = EvalSettings(**{**options, "rope_scaling_factor": parse_factor(args.rope_scaling_factor)})
        data = EvalData(**vars(args.data))
        labels = args.labels or default_labels(args.ckpt)
        if len(labels) != len(args.ckpt):
            raise ValueError(f"--labels gives {len(labels)} names for {len(args.ckpt)} checkpoints.")
        subjects = [Subject(path, label) for path, label in zip(args.ckpt, labels, strict=True)]
        doc = evaluate_checkpoints(subjects, settings, data)
    except (ValueError, DataError, CheckpointError) as error:
        sys.exit(f"error: {error}")
    paths = write_report(doc, args.out)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
