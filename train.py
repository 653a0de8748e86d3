"""Train a GPT: `python train.py [--config configs/X.yaml] [--model.pos_encoding alibi ...]`.

With no arguments it trains configs/shakespeare_char.yaml (Tiny Shakespeare, char-level, a few
minutes on a laptop CPU) and prints a short sample. `--help` lists every option.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from data.errors import DataError
from training.checkpoint import CheckpointError
from training.config import RunConfig
from training.hardware import HardwareError
from training.run import result_summary, train

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "shakespeare_char.yaml"


def build_parser() -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help text
    parser = ArgumentParser(
        prog="train.py",
        description="Train a GPT on any text; the position scheme is --model.pos_encoding.",
        default_config_files=[str(DEFAULT_CONFIG)],
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of options (see configs/).")
    parser.add_class_arguments(RunConfig, None)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = parser.instantiate(args)
        run_config = RunConfig(model=config.model, data=config.data, optim=config.optim, train=config.train)
    except ValueError as error:  # GPTConfig's own checks, e.g. n_embd not divisible by n_head
        sys.exit(f"error: {error}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = train(run_config)
    except (DataError, CheckpointError, HardwareError) as error:
        sys.exit(f"error: {error}")
    if result.sample is not None:
        print(f"\n--- sample ---\n{result.sample}\n--------------")
    print(result_summary(result))


if __name__ == "__main__":
    main()
