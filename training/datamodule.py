"""LightningDataModules over prepared token files and over a synthetic task (`data.tasks`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from posgpt.data.dataset import Batch, FixedWindows, PreparedData, SeededStream, random_windows
from posgpt.data.errors import DataError
from posgpt.data.tasks import TaskConfig, encode, tokenizer_for, training_batch, validation_set
from posgpt.data.tokenizer import CharTokenizer


class _ResumableDataModule(L.LightningDataModule):
    """The training stream's position (micro-batches done) is saved in every checkpoint with the seed and
    restored before the training loader iterates: a resumed run continues the exact stream."""

    def __init__(self, batch_size: int, seed: int) -> None:
        super().__init__()
        self.batch_size, self.seed = batch_size, seed
        self._start = 0

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def _loader(self, data: Any) -> DataLoader:
        """Every DataLoader iterator draws a seed from its generator; with the global one that draw would
        shift dropout's random stream whenever a loader restarts (after a resume, at each validation),
        and a resumed run would no longer match an uninterrupted one. Our batches need no torch RNG."""
        pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(data, batch_size=None, pin_memory=pin, generator=torch.Generator().manual_seed(0))

    def _stream(self, batch: Callable[[int], Batch]) -> DataLoader:
        return self._loader(SeededStream(batch, lambda: self._start))

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        done = 0 if trainer is None else trainer.global_step * trainer.accumulate_grad_batches
        return {"seed": self.seed, "micro_batches": done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise DataError(f"The checkpoint's data stream used seed {state['seed']}, this run {self.seed}.")
        self._start = state["micro_batches"]


class TokenDataModule(_ResumableDataModule):
    """Batches of (x, y) windows of `block_size` tokens from a prepared directory."""

    def __init__(self, data: PreparedData, block_size: int, batch_size: int, seed: int, eval_tokens: int = 0) -> None:
        super().__init__(batch_size, seed)
        self.data, self.block_size = data, block_size
        for split in ("train", "val"):
            n = data.meta[f"{split}_tokens"]
            if n < block_size + 1:
                raise DataError(
                    f"The {split} split has {n} tokens, shorter than one training window of block_size + 1 = "
                    f"{block_size + 1}. Use more text, a smaller --model.block_size, or another --data.val_fraction."
                )
        self.validation = FixedWindows(data, "val", block_size, batch_size, eval_tokens)
        """The fixed validation windows: at most `eval_tokens` tokens (0: the whole split)."""

    def validation_record(self) -> dict[str, int]:
        """What every validation scores, for the log and the checkpoints."""
        windows = len(self.validation.offsets)
        return {"windows": windows, "tokens": windows * self.block_size, "split_tokens": self.data.meta["val_tokens"]}

    def train_dataloader(self) -> DataLoader:
        return self._stream(random_windows(self.data, self.block_size, self.batch_size, self.seed, self.rank))

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.validation)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "validation": self.validation_record()}


class TaskDataModule(_ResumableDataModule):
    """Batches of a synthetic task: a seeded stream of training examples and a fixed validation set."""

    def __init__(self, task: TaskConfig, batch_size: int, seed: int) -> None:
        super().__init__(batch_size, seed)
        self.task, self.tokenizer = task, tokenizer_for(task)
        examples = validation_set(task)  # the same fixed set at every validation: made once
        self._val = [
            tuple(torch.from_numpy(a) for a in encode(self.tokenizer, examples[i : i + batch_size]))
            for i in range(0, len(examples), batch_size)
        ]

    def train_dataloader(self) -> DataLoader:
        return self._stream(task_batches(self.task, self.tokenizer, self.batch_size, self.seed, self.rank))

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val)


def task_batches(
    task: TaskConfig, tokenizer: CharTokenizer, batch_size: int, seed: int, rank: int
) -> Callable[[int], Batch]:
    """Batch i of rank `rank`: training examples of a task, padded per batch; (x, y) with targets -1 off the
    answers."""

    def batch(index: int) -> Batch:
        x, y = encode(tokenizer, training_batch(task, random.Random(f"{seed}/{rank}/{index}"), batch_size))
        return torch.from_numpy(x), torch.from_numpy(y)

    return batch
