"""Train a GPT: `python train.py [--config configs/X.yaml] [--model.pos_encoding alibi ...]`.

With no arguments it trains configs/shakespeare_char.yaml (Tiny Shakespeare, char-level, a few
minutes on a laptop CPU) and prints a short sample. `--help` lists every option.
"""

from __future__ import annotations

import errno
import logging
import sys
import typing
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from core.checkpoint import CheckpointError
from core.device import DeviceError
from data.errors import DataError
from training.callbacks import TrainingStopped
from training.config import RunConfig
from training.run import RunError, result_summary, train

USER_ERRORS = (DataError, CheckpointError, DeviceError, RunError)
"""Problems a user can fix; anything else is a bug and keeps its traceback."""

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "shakespeare_char.yaml"


def build_parser() -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help text
    parser = ArgumentParser(
        prog="train.py",
        description="Train a GPT on any text; the position scheme is --model.pos_encoding.",
        default_config_files=[str(DEFAULT_CONFIG)],
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of options (see configs/).")
    for name, section in typing.get_type_hints(RunConfig).items():
        skip = {"vocab_size"} if name == "model" else None  # the tokenizer's, set from the data
        parser.add_class_arguments(section, name, skip=skip)
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
    except USER_ERRORS as error:  # each says what to do
        sys.exit(f"error: {error}")
    except TrainingStopped as stop:
        print(f"error: {stop}" if stop.exit_code == 1 else str(stop), file=sys.stderr)
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # before training started, or a second Ctrl+C: nothing half-written is kept
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)
    except OSError as error:
        sys.exit(f"error: {os_error_message(error)}")
    if result.sample is not None:
        print(f"\n--- sample ---\n{result.sample}\n--------------")
    print(result_summary(result))


def os_error_message(error: OSError) -> str:
    """A file-system error during training as one line with the fix."""
    where = f" ({error.filename})" if error.filename else ""
    if error.errno == errno.ENOSPC:
        return (
            f"no space left on the device{where}. Checkpoints are written atomically, so the previous last.ckpt "
            "is intact: free some space and continue with the same command and --train.resume auto."
        )
    return f"{error.strerror or error}{where}. Check that the run and data directories can be written."


if __name__ == "__main__":
    main()
