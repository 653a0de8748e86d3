"""The Lightning trainer's row of `python bench.py gpu`: a model trained through
`training.run.train` on random tokens, and the tokens/s the trainer itself logs (its whole per-step
cost: data loading, hooks, logging and callbacks included)."""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from data.dataset import SeededStream
from model import GPTConfig
from training.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from training.logs import metrics_file
from training.run import TrainingData, train

SEED = 1337


class RandomTokens(SeededStream):
    """Batches of random tokens, a function of (seed, index) alone, as the trainer's streams are."""

    def __init__(self, vocab: int, context: int, batch_size: int) -> None:
        super().__init__(batch_size, SEED, 0, lambda: 0)
        self.vocab, self.context = vocab, context

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([SEED, index])
        tokens = torch.from_numpy(rng.integers(0, self.vocab, (self.batch_size, self.context + 1), dtype=np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class RandomTokenData(L.LightningDataModule):
    """The trainer's data for a speed row: random training batches, one validation batch."""

    def __init__(self, vocab: int, context: int, batch_size: int, pin: bool) -> None:
        super().__init__()
        self.stream, self.pin = RandomTokens(vocab, context, batch_size), pin

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream, batch_size=None, pin_memory=self.pin)

    def val_dataloader(self) -> DataLoader:
        return DataLoader([self.stream.batch(10**9)], batch_size=None, pin_memory=self.pin)


@dataclass(frozen=True)
class RandomVocabulary:
    """What the trainer reads of a tokenizer when it samples nothing: the vocabulary's size and a
    description for the checkpoint."""

    vocab_size: int
    end_id: int | None = None

    def meta(self) -> dict[str, Any]:
        return {"kind": "random", "vocab_size": self.vocab_size}


def trainer_tokens_per_s(config: GPTConfig, batch: int, steps: int, options: dict[str, Any]) -> float:
    """Train `config` at `batch` x block_size through the trainer for 1 + 2 x `steps` optimizer steps,
    its tokens/s logged every `steps` steps after the first (which compiles); the last reading (taken
    before the run's final checkpoint is written: `SpeedMonitor`).
    `options`: TrainConfig fields (precision, compile, hardware, ...)."""
    data = TrainingData(
        RandomTokenData(config.vocab_size, config.block_size, batch, pin=options.get("accelerator") == "gpu"),
        RandomVocabulary(config.vocab_size),  # type: ignore[arg-type]  # all the trainer reads of a tokenizer
        {"prepared": "random tokens", "fingerprint": f"random-{SEED}"},
        "random",
    )
    with tempfile.TemporaryDirectory() as tmp:
        train_config = TrainConfig(
            max_steps=1 + 2 * steps, batch_size=batch, eval_interval=10**9, log_interval=steps,
            ckpt_interval=10**9, out_dir=tmp, run_name="lightning", progress_bar=False, sample_tokens=0, **options,
        )  # fmt: skip
        run = RunConfig(model=config, data=DataConfig(input=None, dir=tmp), optim=OptimConfig(), train=train_config)
        torch._dynamo.reset()
        with quiet_lightning():
            result = train(run, data)
        rows = metrics_file(result.run_dir).read_text().splitlines()
    col = rows[0].split(",").index("perf/tokens_per_s")
    return [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]][-1]


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Keep the trainer's model summary, notices and warnings out of the table."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
