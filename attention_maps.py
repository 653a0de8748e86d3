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

from core.cli import Command, run
from core.errors import UserError
from evaluation.attention_maps import MapsConfig
from evaluation.attention_maps import run as draw


def main(cfg: MapsConfig) -> None:
    """Draw, write, say what was written."""
    try:
        paths = draw(cfg)
    except OSError as error:
        raise UserError(f"cannot write the figures to {cfg.out}: {error.strerror or error}.") from error
    print(f"wrote {len(paths)} files to {cfg.out}: " + ", ".join(str(p) for p in paths[:8])
          + (" ..." if len(paths) > 8 else ""))  # fmt: skip


COMMAND = Command("attention_maps.py", MapsConfig, main, __doc__, aliases={"eval_data.": "data."})

if __name__ == "__main__":
    run(COMMAND)
