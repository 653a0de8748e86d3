"""train.py as the tests of several processes run it (tests/test_distributed.py): rank r of W draws the rows
[r B, (r + 1) B) of the batch of W x B that one process draws (so that the ranks together see the batches of one
process at W times the batch size), writes its parameters' shards and the modules compiled to
<run dir>/shards-<rank>.json, and compiles through Dynamo and AOTAutograd without code generation (aot_eager)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from posgpt.core import cli
from posgpt.data.dataset import random_windows
from posgpt.training import datamodule
from posgpt.training.command import COMMAND
from posgpt.training.module import GPTModule


def split_windows(data, block_size: int, batch_size: int, seed: int, rank: int):
    """`random_windows` with rank `rank`'s share of one process' batches of WORLD_SIZE x `batch_size` rows."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    whole = random_windows(data, block_size, batch_size * world, seed, 0)

    def batch(index: int):
        x, y = whole(index)
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return x[rows], y[rows]

    return batch


def recording_shards() -> None:
    """Patch `GPTModule.configure_model` and `nn.Module.compile` to record what the sharding did."""
    compiled: list[str] = []
    real_compile, real_configure = torch.nn.Module.compile, GPTModule.configure_model

    def compile_without_codegen(module: torch.nn.Module, *args, **kwargs) -> None:
        compiled.append(type(module).__name__)
        real_compile(module, backend="aot_eager", fullgraph=True)  # a graph break would raise

    def configure_model(self: GPTModule) -> None:
        real_configure(self)
        params = {name: {"type": type(p).__name__, "shape": list(p.shape),
                         "local": list(p.to_local().shape) if hasattr(p, "to_local") else None,
                         "placements": [str(s) for s in getattr(p, "placements", ())]}
                  for name, p in self.model.named_parameters()}  # fmt: skip
        run_dir = Path(self.config.train.out_dir) / str(self.config.train.run_name)
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"params": params, "compiled": compiled}
        (run_dir / f"shards-{self.global_rank}.json").write_text(json.dumps(record))

    torch.nn.Module.compile = compile_without_codegen
    GPTModule.configure_model = configure_model


if __name__ == "__main__":
    datamodule.random_windows = split_windows
    recording_shards()
    cli.run(COMMAND)
