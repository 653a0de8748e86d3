"""Synthetic length-generalisation tasks: train on short inputs, test on long ones (docs/synthetic.md).
Each task writes seeded examples, a prompt and an answer, over its own small character vocabulary (a
`CharTokenizer`, so checkpoints and sampling work on task models as on any other). The loss is taken on the
answer tokens only (targets -1 elsewhere), and a model is scored by exact match of its greedy answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import asdict, dataclass, field

import numpy as np

from posgpt.core.errors import did_you_mean
from posgpt.data.tokenizer import CharTokenizer

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
    """A key of `TASKS` (docs/synthetic.md): copy | reverse | recall | passkey | flipflop | counting |
    selective_copy."""
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
    """Alphabet of copy, reverse and selective_copy (at most 26 letters), keys of recall (at most 51), digits of
    passkey's key, variables of counting (at most 26)."""
    depths: list[float] | None = None
    """The test sets' second axis (None: the task's own). passkey: where the key sits, 0 = start, 1 = end; flipflop:
    the probability of an ignore; selective_copy: blanks per symbol."""
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
        task = TASKS[self.name]
        if not task.fewest_symbols <= self.symbols <= len(task.alphabet):
            raise ValueError(f"task.symbols for {self.name} must be in {task.fewest_symbols}..{len(task.alphabet)}, "
                             f"got {self.symbols}.")  # fmt: skip
        task.check(self)
        low, high = task.depth_range
        if any(not low <= d <= high for d in self.test_depths) or not self.test_depths:
            raise ValueError(f"task.depths ({task.depth_label}) must lie in [{low:g}, {high:g}], got {self.depths}.")

    @property
    def test_depths(self) -> list[float]:
        """`depths`, or the task's own."""
        return list(TASKS[self.name].default_depths) if self.depths is None else list(self.depths)

    def resolved(self) -> TaskConfig:
        """This task with its depths written out (what studies record)."""
        return dataclasses.replace(self, depths=self.test_depths)

    def fingerprint(self) -> str:
        """Identifies the task and its data (what a resumed run must share)."""
        return hashlib.sha256(json.dumps(asdict(self.resolved()), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    also: tuple[int, ...] = ()
    """Indices of prompt characters that are targets too in training (flip-flop's earlier reads)."""


class Task:
    """One synthetic task: the characters it writes and how it draws an example of length n."""

    alphabet: str  # what its `task.symbols` symbols are the first of
    fixed = ""  # the characters it writes besides them
    fewest_symbols = 2  # the fewest: one symbol is no task (counting's one variable is: the CoPE paper's)
    unit = "items"  # what the length n counts (the x axis of the report)
    depths = False  # whether each test length is scored at every `task.depths` (a second axis of the test sets)
    depth_label = "depth"  # what that axis is, in the report
    default_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    depth_range = (0.0, 1.0)

    def vocabulary(self, task: TaskConfig) -> str:
        return self.alphabet[: task.symbols] + self.fixed

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        raise NotImplementedError

    def check(self, task: TaskConfig) -> None:
        """Raise ValueError where `task`'s lengths cannot be drawn."""


class Copy(Task):
    """`^` s_1 .. s_n `|` -> s_1 .. s_n (or reversed)."""

    alphabet, fixed = SYMBOLS, BOS + SEP

    def __init__(self, reverse: bool = False) -> None:
        self.reverse = reverse

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        s = "".join(rng.choice(SYMBOLS[: task.symbols]) for _ in range(n))
        return Example(BOS + s + SEP, s[::-1] if self.reverse else s)


class Recall(Task):
    """`^` k_1 v_1 .. k_n v_n `?` k_q -> v_q, the keys distinct."""

    alphabet, fixed = KEYS, BOS + QUERY + DIGITS

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        keys = rng.sample(KEYS[: task.symbols], n)
        values = [rng.choice(DIGITS) for _ in keys]
        q = rng.randrange(n)
        pairs = "".join(k + v for k, v in zip(keys, values, strict=True))
        return Example(BOS + pairs + QUERY + keys[q], values[q])

    def check(self, task: TaskConfig) -> None:
        longest = max(task.train_max, *task.eval_lengths)
        if longest > task.symbols:
            raise ValueError(
                f"recall needs distinct keys: lengths up to {longest} pairs need task.symbols >= that (at most "
                f"{len(KEYS)}); lower task.eval_lengths or raise task.symbols."
            )


class Passkey(Task):
    """Filler, the key line at a depth, filler, the question -> the 5 digits; n counts every character."""

    alphabet, fixed = DIGITS, FILLER + KEY_LINE.format("") + QUESTION + DIGITS
    unit = "characters"
    depths = True

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        depth = rng.random() if depth is None else depth
        key = "".join(rng.choice(DIGITS[: task.symbols]) for _ in range(5))
        line = KEY_LINE.format(key)
        filler_len = n - len(line) - len(QUESTION) - len(key)  # n counts every character, the answer's too
        filler = (FILLER * (filler_len // len(FILLER) + 1))[:filler_len]
        cut = round(depth * filler_len)
        return Example(filler[:cut] + line + filler[cut:] + QUESTION, key)

    def check(self, task: TaskConfig) -> None:
        shortest = len(KEY_LINE.format("0" * 5)) + len(QUESTION) + 5 + 1
        if task.train_min < shortest:
            raise ValueError(f"passkey lengths count characters; task.train_min must be at least {shortest}.")


class FlipFlop(Task):
    """Flip-flop language modelling (Liu et al., NeurIPS 2023): n instructions of an op and a bit, w (write),
    i (ignore) or r (read), the first a write and the last a read; a read's bit is the last write's. Ignores come
    with probability p (`depths`; training 0.8, their train set), writes and reads share the rest; the bits after
    the earlier reads are training targets too, the last read's bit is the answer."""

    alphabet = SYMBOLS  # (task.symbols is not used: the bits are its symbols)
    unit = "instructions"
    depths = True
    depth_label = "ignore probability"
    default_depths = (0.1, 0.8, 0.98)  # their dense test, in-distribution and sparse test sets
    depth_range = (0.0, 0.99)
    TRAIN_IGNORE = 0.8

    def vocabulary(self, task: TaskConfig) -> str:
        return "wir01"

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        ignore = self.TRAIN_IGNORE if depth is None else depth
        ops = ["w"] + [rng.choices("iwr", (ignore, (1 - ignore) / 2, (1 - ignore) / 2))[0] for _ in range(n - 2)]
        text, also, memory = [], [], "0"
        for op in [*ops, "r"]:
            bit = memory if op == "r" else rng.choice("01")
            memory = bit if op == "w" else memory
            text.append(op + bit)
            if op == "r":
                also.append(2 * len(text) - 1)
        prompt = "".join(text)
        return Example(prompt[:-1], prompt[-1], tuple(also[:-1]))

    def check(self, task: TaskConfig) -> None:
        if task.train_min < 2:
            raise ValueError("flipflop needs at least 2 instructions (a write and a read): task.train_min >= 2.")


class Counting(Task):
    """Counting as in the CoPE paper (Golovneva et al. 2024; the authors' generator, facebookresearch/RAM
    projects/cope `count_data_gen.py`): n steps, each `x=0;` (set a variable), `p` (pass) or `x+` (increment a
    set one, at most to 10), drawn 1 : 50 : 7, a draw that cannot be done drawn again; then `?x` asks for a set
    variable's value. One character per token of theirs (`pass;` is `p`), but 10 is two."""

    alphabet, fixed = SYMBOLS, "=;p+?" + DIGITS
    fewest_symbols = 1
    unit = "steps"
    MAX_VALUE = 10
    WEIGHTS = {"set": 1, "pass": 50, "inc": 7}

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        names = SYMBOLS[: task.symbols]
        while True:  # their generator retries a sample that asks nothing (no variable set)
            values: dict[str, int] = {}
            text = []
            while len(text) < n:  # a draw that cannot be done adds no step: it is drawn again
                op = rng.choices(list(self.WEIGHTS), list(self.WEIGHTS.values()))[0]
                if op == "set":
                    name = rng.choice(names)
                    values[name] = 0
                    text.append(f"{name}=0;")
                elif op == "pass":
                    text.append("p")
                elif values and values[name := rng.choice(sorted(values))] < self.MAX_VALUE:
                    values[name] += 1
                    text.append(f"{name}+")
            if values:
                name = rng.choice(sorted(values))
                return Example("".join(text) + "?" + name, str(values[name]))


class SelectiveCopy(Task):
    """Selective copy (Gu and Dao 2023, as the CoPE paper uses it): `^`, n symbols scattered among blanks `.`,
    `|` -> the n symbols in order. Blanks per symbol are `depths` (training 1: their 256 blanks among 256 symbols;
    tests dense 0.5 and sparse 2: their 128 and 512)."""

    alphabet, fixed = SYMBOLS, BOS + SEP + "."
    depths = True
    depth_label = "blanks per symbol"
    default_depths = (0.5, 1.0, 2.0)
    depth_range = (0.0, 16.0)

    def example(self, task: TaskConfig, rng: random.Random, n: int, depth: float | None) -> Example:
        symbols = [rng.choice(SYMBOLS[: task.symbols]) for _ in range(n)]
        cells = n + round(n * (1.0 if depth is None else depth))
        places = dict(zip(sorted(rng.sample(range(cells), n)), symbols, strict=True))  # the symbols' cells, in order
        row = "".join(places.get(cell, ".") for cell in range(cells))
        return Example(BOS + row + SEP, "".join(symbols))


TASKS: dict[str, Task] = {
    "copy": Copy(),
    "reverse": Copy(reverse=True),
    "recall": Recall(),
    "passkey": Passkey(),
    "flipflop": FlipFlop(),
    "counting": Counting(),
    "selective_copy": SelectiveCopy(),
}


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
    return training_batch(task, random.Random(f"{task.seed}/{task.name}/val"), task.val_size)


def encode(tokenizer: CharTokenizer, examples: list[Example], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets (B, T) of whole examples, right-padded: targets -1 off the answer positions."""
    rows = [(tokenizer.encode(e.prompt), tokenizer.encode(e.answer)) for e in examples]
    T = max(len(p) + len(a) for p, a in rows) - 1
    x, y = np.full((len(rows), T), pad, dtype=np.int64), np.full((len(rows), T), -1, dtype=np.int64)
    for i, ((prompt, answer), example) in enumerate(zip(rows, examples, strict=True)):
        ids = prompt + answer
        x[i, : len(ids) - 1] = ids[:-1]
        y[i, len(prompt) - 1 : len(ids) - 1] = answer  # the position before each answer token predicts it
        for j in example.also:
            y[i, j - 1] = prompt[j]
    return x, y
