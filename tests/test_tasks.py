"""The tasks that tell the data-dependent schemes apart (issue 37): flip-flop, counting and selective copy, beyond
what test_synthetic.py checks of every task (each answer worked out from its prompt), and one shrunk study."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from posgpt.core import cli
from posgpt.data.tasks import TaskConfig, encode, eval_set, make_example, tokenizer_for
from posgpt.evaluation.tasks import correct, evaluate_task
from posgpt.experiments import synthetic
from posgpt.model import GPT, GPTConfig


def test_flipflop_reads_the_last_write_and_trains_on_every_read():
    """Liu et al.: w / i / r with a bit each, the first a write, the last a read; every read's bit is the last
    write's; ignores at the asked probability (training 0.8)."""
    task = TaskConfig(name="flipflop", train_min=8, train_max=64, eval_lengths=[64])
    rng = random.Random(0)
    ignores = []
    for n in (2, 9, 64):
        for depth in (None, 0.98, 0.1):
            e = make_example(task, rng, n, depth)
            text = e.prompt + e.answer
            ops, bits = text[0::2], text[1::2]
            assert len(ops) == n and ops[0] == "w" and ops[-1] == "r" and set(ops) <= set("wir")
            last = None
            for i, (op, bit) in enumerate(zip(ops, bits, strict=True)):
                last = bit if op == "w" else last
                if op == "r":
                    assert bit == last
                    assert i == n - 1 or 2 * i + 1 in e.also  # an earlier read's bit: a training target
            assert len(e.also) == ops.count("r") - 1
    for depth in (0.98, 0.1):
        middle = "".join(make_example(task, rng, 64, depth).prompt[2:-2:2] for _ in range(100))
        ignores.append(middle.count("i") / len(middle))
    assert abs(ignores[0] - 0.98) < 0.01 and abs(ignores[1] - 0.1) < 0.02
    e = make_example(task, rng, 12)
    x, y = encode(tokenizer_for(task), [e])
    assert np.count_nonzero(y >= 0) == len(e.also) + 1


def test_counting_draws_its_steps_as_the_authors_generator():
    """Set, pass and increment drawn 1 : 50 : 7 (a draw that cannot be done, drawn again); the answers are checked
    by replaying the program in test_synthetic.py."""
    task = TaskConfig(name="counting", symbols=3, train_min=3, train_max=200, eval_lengths=[200])
    rng = random.Random(1)
    text = "".join(make_example(task, rng, 200).prompt for _ in range(100))
    sets, incs = text.count("="), text.count("+")
    assert text.count("p") > 5 * incs > 5 * sets > 0
    one = TaskConfig(name="counting", symbols=1, train_min=3, train_max=20, eval_lengths=[20])  # their 1 variable
    assert {c for e in eval_set(one, 20, size=20) for c in e.prompt if c.isalpha() and c != "p"} == {"a"}
    with pytest.raises(ValueError, match=r"task.symbols for copy must be in 2\.\.26, got 1"):
        TaskConfig(name="copy", symbols=1)


@pytest.mark.parametrize("depth", [0.5, 1.0, 2.0])
def test_selective_copy_scatters_the_symbols_among_blanks(depth):
    task = TaskConfig(name="selective_copy", train_min=4, train_max=16, eval_lengths=[16])
    for e in eval_set(task, 16, depth, size=5):
        body = e.prompt[1:-1]
        assert e.prompt[0] == "^" and e.prompt[-1] == "|" and body.replace(".", "") == e.answer
        assert len(e.answer) == 16 and body.count(".") == round(16 * depth)


def test_counting_prompts_of_one_length_differ_and_each_example_keeps_its_own_score():
    """Counting's n steps are 1 or 2 characters and its answer 10 two: the examples of one test length come in
    batches of one prompt and answer length, and each score goes back to its own example. A stand-in model
    answers right exactly where the prompt's length is even."""
    task = TaskConfig(name="counting", train_min=4, train_max=8, eval_lengths=[12], test_size=20)
    tokenizer, examples = tokenizer_for(task), eval_set(task, 12)
    assert len({len(e.prompt) for e in examples}) > 2
    answers = {e.prompt: tokenizer.encode(e.answer) for e in examples}

    class Oracle(torch.nn.Module):
        wte = torch.nn.Embedding(1, 1)

        def generate(self, prompts, n, temperature, max_context):
            rows = []
            for ids in prompts.tolist():
                answer = answers[tokenizer.decode(ids)]
                rows.append(ids + (answer if len(ids) % 2 == 0 else [(t + 1) % tokenizer.vocab_size for t in answer]))
            return torch.tensor(rows)

    scores = correct(Oracle(), tokenizer, examples, batch_size=3)
    assert scores == [[len(e.prompt) % 2 == 0] * len(e.answer) for e in examples]


def test_flipflop_and_counting_are_scored_per_length_and_ignore_rate():
    model = GPT(GPTConfig(vocab_size=32, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    for name, lengths in (("flipflop", [8, 16]), ("counting", [10])):
        task = TaskConfig(name=name, train_min=4, train_max=8, eval_lengths=lengths, test_size=4)
        rows = evaluate_task(model, tokenizer_for(task), task)
        depths = task.test_depths if name == "flipflop" else [None]
        assert [(r["length"], r["depth"]) for r in rows] == [(n, d) for n in lengths for d in depths]
        assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)


def test_a_shrunk_flipflop_study_of_cope_and_forgetting_attention(tmp_path):
    """`posgpt study synthetic` on a task scored per length and ignore probability: each model trained
    from the command line and tested with its KV cache."""
    args = [
        "--config", str(Path(__file__).parents[1] / "configs" / "synthetic_flipflop.yaml"),
        "--out_dir", str(tmp_path / "report"), "--task.train_max", "8", "--task.eval_lengths", "[8,16]",
        "--task.test_size", "3", "--schemes", "[cope]",
        "--variants", "[{name: fox, model: {attention: forgetting, pos_encoding: none}}]",
        "--run.model.block_size", "16", "--run.model.n_layer", "1", "--run.model.n_embd", "32",
        "--run.train.max_steps", "3", "--run.train.eval_interval", "3", "--run.train.logger", "none",
    ]  # fmt: skip
    cli.run(synthetic.COMMAND, args)
    report = tmp_path / "report"
    doc = json.loads((report / "results.json").read_text())
    assert [(r["label"], r["pos_encoding"], r["model"]["attention"]) for r in doc["runs"]] == [
        ("cope", "cope", "softmax"),
        ("fox", "none", "forgetting"),
    ]
    assert [(r["length"], r["depth"]) for r in doc["runs"][1]["results"]] == [
        (n, d) for n in (8, 16) for d in (0.1, 0.8, 0.98)
    ]
    assert (report / "flipflop_depth.png").stat().st_size > 0
    assert "ignore probability" in (report / "results.md").read_text()


@pytest.mark.parametrize("name", ["flipflop", "counting", "selective_copy"])
def test_the_shipped_study_configs_hold_their_longest_training_example(name):
    config = cli.parse(
        synthetic.COMMAND, ["--config", str(Path(__file__).parents[1] / "configs" / f"synthetic_{name}.yaml")]
    )
    assert config.task.name == name
    assert [m.name for m in config.models()] == ["rope", "alibi", "none", "cope", "fox", "stick-breaking"]
    rng = random.Random(0)
    longest = max(len(e.prompt) + len(e.answer) - 1 for e in [make_example(config.task, rng, config.task.train_max)
                                                                for _ in range(500)])  # fmt: skip
    assert longest <= config.run.model.block_size
