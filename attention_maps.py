"""Look inside trained models: `python attention_maps.py --ckpt A.ckpt --prompt "ROMEO:" --out maps`.

With --prompt (up to 64 tokens): per checkpoint, one PNG per layer with a grid of heads (query x key
heatmaps, token labels on both axes, one colour scale, keys a query cannot see left blank) and one
PNG of every layer's attention averaged over heads. With --lengths 256 1024 4096: per length, one
figure of attention mass against distance, attention entropy and the mass on the first tokens
against query position, per layer (heads averaged, or each head for one or two checkpoints),
several checkpoints on the same axes, the training length marked. results.json holds every number
plotted.

The weights are recomputed in float32 on the eager reference kernel from the checkpoint's
parameters: the fused kernels (SDPA, FlexAttention) that train and sample never form them. The
logic is in evaluation/attention_maps.py.
"""

from __future__ import annotations

import logging
import sys

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from core.checkpoint import CheckpointError
from core.device import DeviceError
from data.errors import DataError
from evaluation.attention_maps import MapsConfig, run


def build_parser() -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help text
    parser = ArgumentParser(prog="attention_maps.py", description=__doc__)
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of these options.")
    listed = {  # lists given as `--lengths 256 1024`, as evaluate.py takes --ckpt
        "ckpt": (str, "checkpoints written by train.py (several: their figures share axes, one colour each)"),
        "labels": (str, "a name per checkpoint (default: its run directory); checkpoints sharing a name are "
                   "seeds of one model, averaged in the long-context figures"),
        "layers": (int, "layers to draw heatmaps of (default: all), from 0"),
        "heads": (int, "heads to draw in each heatmap grid (default: all), from 0"),
        "lengths": (int, "context lengths for the long-context statistics, e.g. 256 1024 4096"),
    }  # fmt: skip
    for name, (kind, help_text) in listed.items():
        parser.add_argument(f"--{name}", nargs="+", type=kind, required=name == "ckpt", help=help_text)
    parser.add_class_arguments(MapsConfig, None, skip=set(listed))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = parser.instantiate(args)
        cfg = MapsConfig(**{name: getattr(config, name) for name in MapsConfig.__dataclass_fields__})
        paths = run(cfg)
    except (ValueError, DataError, CheckpointError, DeviceError) as error:  # each says how to fix it
        sys.exit(f"error: {error}")
    except OSError as error:
        sys.exit(f"error: cannot write the figures to {args.out}: {error.strerror or error}.")
    print(f"wrote {len(paths)} files to {cfg.out}: " + ", ".join(str(p) for p in paths[:8])
          + (" ..." if len(paths) > 8 else ""))  # fmt: skip


if __name__ == "__main__":
    main()
