"""Synthetic length-generalisation tasks: train on short inputs, test on long ones (docs/synthetic.md).
Each task writes seeded examples, a prompt and an answer, over its own small character vocabulary (a
`CharTokenizer`, so checkpoints and sampling work on task models as on any other). The loss is taken on the
answer tokens only (targets -1 elsewhere), and a model is scored by exact match of its greedy answer.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field

import numpy as np

from core.errors import did_you_mean
from data.tokenizer import CharTokenizer

BOS, SEP, QUERY = "^", "|", "?"
SYMBOLS = "abcdefghijklmnopqrstuvwxyz"
KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "".join(chr(c) for c in range(0x3B1, 0x3CA))  # 26 Latin + 25 Greek
DIGITS = "0123456789"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_LINE = "The pass key is {}. Remember it. "
QUESTION = "What is the pass key? "


@dataclass
class TaskConfig:
    """A synthetic task, its training lengths and its test sets."""

    name: str = "copy"
    """A key of `TASKS`: copy, reverse, recall (associative recall) or passkey."""
    train_min: int = 4
    """Shortest training length n (symbols for copy/reverse, pairs for recall, characters for passkey)."""
    train_max: int = 20
    """Longest training length n; each training example draws n uniformly from [train_min, train_max]."""
    eval_lengths: list[int] = field(default_factory=lambda: [5, 10, 20, 40, 80, 160])
    """Lengths n of the fixed test sets (up to 8-16x train_max shows length generalisation)."""
    test_size: int = 100
    """Test examples per length (per length and depth for passkey)."""
    val_size: int = 256
    """Validation examples, at training lengths (the loss logged during training)."""
    symbols: int = 10
    """Alphabet of copy and reverse (at most 26 letters), keys of recall (at most 51), digits of passkey's key."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """passkey: where the key sits in the filler, 0 = start, 1 = end (training draws it uniformly)."""
    seed: int = 0
    """Seed of the test and validation sets (training examples come from train.seed)."""

    def __post_init__(self) -> None:
        if not 1 <= self.train_min <= self.train_max:
            raise ValueError(f"Need 1 <= task.train_min <= task.train_max, got {self.train_min}, {self.train_max}.")
        if not self.eval_lengths or min(self.eval_lengths) < 1 or self.test_size < 1 or self.val_size < 1:
            raise ValueError("task.eval_lengths, task.test_size and task.val_size must be positive.")
        self.eval_lengths = sorted(set(self.eval_lengths))
        if self.name not in TASKS:
            hint = did_you_mean(self.name, list(TASKS), "") or "."
            raise ValueError(f"task.name must be one of {', '.join(TASKS)}, got {self.name!r}{hint}")
        limit = TASKS[self.name].alphabet
        if not 2 <= self.symbols <= limit:
            raise ValueError(f"task.symbols for {self.name} must be in 2..{limit}, got {self.symbols}.")
        TASKS[self.name].check(self)
        if any(not 0.0 <= d <= 1.0 for d in self.depths) or not self.depths:
            raise ValueError(f"task.depths must lie in [0, 1], got {self.depths}.")

    def fingerprint(self) -> str:
        """Identifies the task and its data (what a resumed run must share)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    length: int
    depth: float | None = None


class Task:
    """One synthetic task: the characters it writes and how it draws an example of length n."""

    alphabet: int  # the most symbols (`task.symbols`) it can draw from
    unit = "items"  # what the length n counts (the x axis of the report)
    depths = False  # whether each test length is scored at every `task.depths` (the key's place in the text)

    def vocabulary(self, task: TaskConfig) -> str:
        raise NotImplementedError

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        raise NotImplementedError

    def check(self, task: TaskConfig) -> None:
        """Raise ValueError where `task`'s lengths cannot be drawn."""


class Copy(Task):
    """`^` s_1 .. s_n `|` -> s_1 .. s_n (or reversed)."""

    alphabet = len(SYMBOLS)

    def __init__(self, reverse: bool = False) -> None:
        self.reverse = reverse

    def vocabulary(self, task: TaskConfig) -> str:
        return BOS + SEP + SYMBOLS[: task.symbols]

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        s = "".join(rng.choice(SYMBOLS[: task.symbols]) for _ in range(n))
        return Example(BOS + s + SEP, s[::-1] if self.reverse else s, n)


class Recall(Task):
    """`^` k_1 v_1 .. k_n v_n `?` k_q -> v_q, the keys distinct."""

    alphabet = len(KEYS)

    def vocabulary(self, task: TaskConfig) -> str:
        return BOS + QUERY + KEYS[: task.symbols] + DIGITS

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        keys = rng.sample(KEYS[: task.symbols], n)
        values = [rng.choice(DIGITS) for _ in keys]
        q = rng.randrange(n)
        pairs = "".join(k + v for k, v in zip(keys, values, strict=True))
        return Example(BOS + pairs + QUERY + keys[q], values[q], n)

    def check(self, task: TaskConfig) -> None:
        longest = max(task.train_max, *task.eval_lengths)
        if longest > task.symbols:
            raise ValueError(
                f"recall needs distinct keys: lengths up to {longest} pairs need task.symbols >= that (at most "
                f"{len(KEYS)}); lower task.eval_lengths or raise task.symbols."
            )


class Passkey(Task):
    """Filler, the key line at a depth, filler, the question -> the 5 digits; n counts every character."""

    alphabet = len(DIGITS)
    unit = "characters"
    depths = True

    def vocabulary(self, task: TaskConfig) -> str:
        return FILLER + KEY_LINE.format("") + QUESTION + DIGITS

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        depth = rng.random() if depth is None else depth
        key = "".join(rng.choice(DIGITS[: task.symbols]) for _ in range(5))
        line = KEY_LINE.format(key)
        filler_len = n - len(line) - len(QUESTION) - len(key)  # n counts every character, the answer's too
        filler = (FILLER * (filler_len // len(FILLER) + 1))[:filler_len]
        cut = round(depth * filler_len)
        return Example(filler[:cut] + line + filler[cut:] + QUESTION, key, n, depth)

    def check(self, task: TaskConfig) -> None:
        shortest = len(KEY_LINE.format("0" * 5)) + len(QUESTION) + 5 + 1
        if task.train_min < shortest:
            raise ValueError(f"passkey lengths count characters; task.train_min must be at least {shortest}.")


TASKS: dict[str, Task] = {"copy": Copy(), "reverse": Copy(reverse=True), "recall": Recall(), "passkey": Passkey()}


def tokenizer_for(task: TaskConfig) -> CharTokenizer:
    return CharTokenizer(TASKS[task.name].vocabulary(task))


def make_example(task: TaskConfig, rng: random.Random, n: int, depth: float | None = None) -> Example:
    """One example of length `n` (and, for a task with depths, `depth`; drawn where None)."""
    return TASKS[task.name].example(task, rng, n, depth)


def training_batch(task: TaskConfig, rng: random.Random, batch_size: int) -> list[Example]:
    """`batch_size` examples, each of a length drawn uniformly from the training range."""
    return [make_example(task, rng, rng.randint(task.train_min, task.train_max)) for _ in range(batch_size)]


def eval_set(task: TaskConfig, n: int, depth: float | None = None, size: int | None = None) -> list[Example]:
    """The fixed test examples of length `n` (and depth): the same for every model and run."""
    rng = random.Random(f"{task.seed}/{task.name}/test/{n}/{depth}")
    return [make_example(task, rng, n, depth) for _ in range(size or task.test_size)]


def validation_set(task: TaskConfig) -> list[Example]:
    rng = random.Random(f"{task.seed}/{task.name}/val")
    return training_batch(task, rng, task.val_size)


def encode(tokenizer: CharTokenizer, examples: list[Example], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets (B, T) of whole examples, right-padded: targets -1 off the answer positions."""
    rows = [(tokenizer.encode(e.prompt), tokenizer.encode(e.answer)) for e in examples]
    T = max(len(p) + len(a) for p, a in rows) - 1
    x = np.full((len(rows), T), pad, dtype=np.int64)
    y = np.full((len(rows), T), -1, dtype=np.int64)
    for i, (prompt, answer) in enumerate(rows):
        ids = prompt + answer
        x[i, : len(ids) - 1] = ids[:-1]
        y[i, len(prompt) - 1 : len(ids) - 1] = answer  # the position before each answer token predicts it
    return x, y
