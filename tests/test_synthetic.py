"""Synthetic length-generalisation tasks: the generators against plain checks, loss masking, a tiny
model that learns to copy, accuracy against a direct loop, and `posgpt study synthetic` end to end
(randomized positions resume exactly: test_gpu_paths.py's resume test)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import evaluate as evaluate_script
from posgpt.core import cli
from posgpt.data import tasks as registry
from posgpt.data.tasks import KEYS, TaskConfig, encode, eval_set, make_example, tokenizer_for, training_batch
from posgpt.evaluation.task_report import depth_figure
from posgpt.evaluation.tasks import evaluate_task
from posgpt.experiments import synthetic
from posgpt.model import GPT, GPTConfig
from posgpt.training.datamodule import task_batches

from helpers import assert_png, cli_error, comparable_report, exits_with, signal_during

TASKS = {
    "copy": TaskConfig(name="copy", train_min=3, train_max=9, eval_lengths=[4, 12]),
    "reverse": TaskConfig(name="reverse", train_min=3, train_max=9, eval_lengths=[4, 12]),
    "recall": TaskConfig(name="recall", train_min=2, train_max=8, eval_lengths=[4, 12], symbols=20),
    "passkey": TaskConfig(name="passkey", train_min=64, train_max=160, eval_lengths=[100, 300]),
    "flipflop": TaskConfig(name="flipflop", train_min=2, train_max=12, eval_lengths=[8, 24]),
    "counting": TaskConfig(name="counting", train_min=3, train_max=12, eval_lengths=[10, 40], symbols=3),
    "selective_copy": TaskConfig(name="selective_copy", train_min=3, train_max=9, eval_lengths=[4, 12]),
}
COUNTING_STEP = re.compile(r"[a-z]=0;|p|[a-z]\+")


def test_every_registered_task_has_a_test_config_here():
    """A new entry of `data.tasks.TASKS` fails here until the tests below draw its examples."""
    assert set(TASKS) == set(registry.TASKS)


def expected_answer(name: str, prompt: str) -> str:
    """What the answer must be, worked out from the prompt alone."""
    if name in ("copy", "reverse"):
        assert prompt[0] == "^" and prompt[-1] == "|"
        body = prompt[1:-1]
        return body if name == "copy" else body[::-1]
    if name == "recall":
        pairs, query = prompt[1:].split("?")
        table = {pairs[i]: pairs[i + 1] for i in range(0, len(pairs), 2)}
        assert len(table) == len(pairs) // 2  # distinct keys
        return table[query]
    if name == "flipflop":  # the bit of the last write
        ops, bits = prompt[0::2], prompt[1::2]
        assert ops[0] == "w" and ops[-1] == "r" and set(ops) <= set("wir")
        return bits[ops.rindex("w")]
    if name == "counting":  # the program run
        program, asked = prompt.split("?")
        values: dict[str, int] = {}
        assert "".join(COUNTING_STEP.findall(program)) == program
        for step in COUNTING_STEP.findall(program):
            if step.endswith("+"):
                values[step[0]] += 1  # a set variable, never past 10
                assert values[step[0]] <= 10
            elif step != "p":
                values[step[0]] = 0
        return str(values[asked])
    if name == "selective_copy":
        assert prompt[0] == "^" and prompt[-1] == "|"
        return prompt[1:-1].replace(".", "")
    found = re.findall(r"The pass key is (\d+)\.", prompt)
    assert len(found) == 1 and prompt.endswith("What is the pass key? ")
    return found[0]


@pytest.mark.parametrize("name", TASKS)
def test_every_answer_is_right_and_lengths_are_as_configured(name):
    task = TASKS[name]
    rng = random.Random(0)
    examples = training_batch(task, rng, 400)
    for e in examples + eval_set(task, task.eval_lengths[-1]):
        assert e.answer == expected_answer(name, e.prompt)
    lengths = Counter(  # the length n of each, read back from its text
        {"copy": len(e.answer), "reverse": len(e.answer), "recall": (len(e.prompt) - 3) // 2,
         "passkey": len(e.prompt) + len(e.answer), "flipflop": (len(e.prompt) + 1) // 2,
         "counting": len(COUNTING_STEP.findall(e.prompt)), "selective_copy": len(e.answer)}[name]
        for e in examples
    )  # fmt: skip
    assert set(lengths) <= set(range(task.train_min, task.train_max + 1))
    if name != "passkey":  # every training length drawn, about equally often
        assert set(lengths) == set(range(task.train_min, task.train_max + 1))
        assert max(lengths.values()) < 2.5 * min(lengths.values())
    tokenizer = tokenizer_for(task)
    assert tokenizer.decode(tokenizer.encode(examples[0].prompt)) == examples[0].prompt


def test_passkey_depth_places_the_key():
    task = TASKS["passkey"]
    positions = [make_example(task, random.Random(1), 200, d).prompt.index("The pass key") for d in (0.0, 0.5, 1.0)]
    assert positions[0] == 0 and positions[0] < positions[1] < positions[2]


@pytest.mark.parametrize("name", TASKS)
def test_the_same_seed_gives_the_same_data(name):
    task = TASKS[name]
    tokenizer = tokenizer_for(task)

    def stream(seed):
        return task_batches(task, tokenizer, 8, seed, rank=0)

    first, again, other = stream(3)(5), stream(3)(5), stream(4)(5)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    assert eval_set(task, task.eval_lengths[0]) == eval_set(task, task.eval_lengths[0])


def test_the_loss_is_on_the_answer_tokens_only():
    task = TASKS["reverse"]
    tokenizer = tokenizer_for(task)
    examples = training_batch(task, random.Random(2), 6)
    x, y = encode(tokenizer, examples)
    for row, e in enumerate(examples):
        scored = np.flatnonzero(y[row] >= 0)
        assert len(scored) == len(e.answer)
        assert tokenizer.decode(y[row, scored].tolist()) == e.answer
        assert scored[0] == len(e.prompt) - 1  # the prompt's last token predicts the first answer token
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16))
    logits, loss = model(torch.from_numpy(x), torch.from_numpy(y))
    mask = torch.from_numpy(y >= 0)
    direct = F.cross_entropy(logits[mask], torch.from_numpy(y)[mask])
    torch.testing.assert_close(loss, direct)


def _learn_copy(pos_encoding: str, steps: int) -> tuple[GPT, TaskConfig]:
    task = TaskConfig(name="copy", train_min=2, train_max=6, eval_lengths=[4, 6, 12], symbols=5, test_size=60)
    tokenizer = tokenizer_for(task)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=64,
                          pos_encoding=pos_encoding))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = task_batches(task, tokenizer, 32, seed=0, rank=0)
    for step in range(steps):
        x, y = batch(step)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval(), task


@torch.no_grad()
def _direct_loop_matches(model: GPT, task: TaskConfig) -> None:
    """evaluate_task's accuracy and token accuracy against a direct greedy loop, with batches that do not divide
    the test set."""
    tokenizer = tokenizer_for(task)
    task = dataclasses.replace(task, eval_lengths=[4, 9], test_size=10)
    rows = evaluate_task(model, tokenizer, task, batch_size=3)
    for row in rows:
        hits, token_hits = 0, 0
        for e in eval_set(task, row["length"]):
            ids = tokenizer.encode(e.prompt)
            for _ in e.answer:  # no cache: the whole sequence again for every token
                logits, _ = model(torch.tensor([ids]))
                ids.append(int(logits[0, -1].argmax()))
            answer = tokenizer.decode(ids[len(ids) - len(e.answer) :])
            hits += answer == e.answer
            token_hits += sum(a == b for a, b in zip(answer, e.answer, strict=True))
        assert row["accuracy"] == hits / task.test_size
        assert row["token_accuracy"] == pytest.approx(token_hits / (task.test_size * row["length"]))
    assert 0 < rows[-1]["accuracy"] < rows[0]["accuracy"] or rows[-1]["accuracy"] == 0  # not a constant


@pytest.mark.slow
def test_a_tiny_model_learns_to_copy_and_its_accuracy_equals_a_direct_loop():
    """One model trained for both (a module fixture would be trained once per xdist worker)."""
    model, task = _learn_copy("rope", 300)
    rows = evaluate_task(model, tokenizer_for(task), task)
    accuracy = {r["length"]: r["accuracy"] for r in rows}
    # at training lengths, after 300 steps (about 0.6 and 0.45 then; chance is 5^-n)
    assert accuracy[4] >= 0.4 and accuracy[6] >= 0.3
    _direct_loop_matches(model, task)


def test_config_mistakes_fail_clearly():
    with pytest.raises(ValueError, match="distinct keys"):
        TaskConfig(name="recall", train_max=8, eval_lengths=[40], symbols=20)
    with pytest.raises(ValueError, match="symbols"):
        TaskConfig(name="copy", symbols=27)
    with pytest.raises(ValueError, match="got 'cpy'; did you mean copy"):
        TaskConfig(name="cpy")
    with pytest.raises(ValueError, match="at least 64"):
        TaskConfig(name="passkey", train_min=20)
    args = ["--config", str(Path(__file__).parents[1] / "configs" / "synthetic_copy.yaml")]
    with pytest.raises(ValueError, match="raise run.model.block_size"):
        cli.parse(synthetic.COMMAND, [*args, "--task.train_max", "40"])
    with pytest.raises(ValueError, match="raise model.block_size to 512"):
        variants = "[{name: x, model: {pos_encoding: learned}, train: {random_positions: 512}}]"
        cli.parse(synthetic.COMMAND, [*args, "--variants", variants])
    with pytest.raises(ValueError, match="at least model.block_size"):
        cli.parse(synthetic.COMMAND, [*args, "--run.train.random_positions", "32"])
    assert len(KEYS) == 51


@pytest.mark.plot  # the task report's figures rendered
def test_the_experiment_end_to_end_with_reuse(tmp_path, capsys):
    args = [
        "--config", str(Path(__file__).parents[1] / "configs" / "synthetic_copy.yaml"),
        "--out_dir", str(tmp_path / "report"),
        "--task.name", "passkey", "--task.train_min", "64", "--task.train_max", "64",
        "--task.eval_lengths", "[64,100]", "--task.test_size", "3", "--task.depths", "[0.0,1.0]",
        "--schemes", "[alibi]",
        "--variants", "[{name: rope-rp, model: {pos_encoding: rope}, train: {random_positions: 128}}]",
        "--seeds", "[1,2]", "--run.model.block_size", "64", "--run.model.n_layer", "1", "--run.model.n_embd", "32",
        "--run.train.max_steps", "4", "--run.train.eval_interval", "4", "--run.train.logger", "none",
    ]  # fmt: skip
    cli.run(synthetic.COMMAND, args)
    report = tmp_path / "report"
    for name in ("results.json", "results.md", "experiment.yaml"):
        assert (report / name).stat().st_size > 0
    for name in ("accuracy_vs_length.png", "passkey_depth.png"):
        assert_png(report / name)
    doc = json.loads((report / "results.json").read_text())
    panels = [ax for ax in depth_figure(doc).axes if ax.images]  # each cell's value printed in it
    assert [[t.get_text() for t in ax.texts] for ax in panels] == [
        [f"{100 * a:.0f}" for a in accuracies] for accuracies in _depth_grid(doc)
    ]
    assert [(r["label"], r["seed"]) for r in doc["runs"]] == [
        ("alibi", 1),
        ("rope-rp", 1),
        ("alibi", 2),
        ("rope-rp", 2),
    ]
    assert {r["random_positions"] for r in doc["runs"]} == {0, 128}
    rows = doc["runs"][0]["results"]
    assert [(r["length"], r["depth"]) for r in rows] == [(64, 0.0), (64, 1.0), (100, 0.0), (100, 1.0)]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["examples"] == 3 for r in rows)
    table = (report / "results.md").read_text()
    assert "| rope-rp | rope | 2 |" in table and "±" in table
    cli.run(synthetic.COMMAND, args)  # everything trained: reused, only evaluated again
    assert json.loads((report / "results.json").read_text())["experiment"]["train_wall_s"] == {}
    # a task model has no text split to evaluate perplexity on
    message = cli_error(capsys, evaluate_script.COMMAND, ["--ckpt", doc["runs"][0]["checkpoint"], "--out",
                                                          str(tmp_path / "ppl")])  # fmt: skip
    assert "synthetic task 'passkey'" in message


def test_a_study_stopped_by_its_time_limit_and_killed_in_validation_resumes_to_the_same_report(
    tmp_path, monkeypatch, capsys
):
    """The retrieval recipe, shrunk: stopped by --max_minutes (exit 75), then killed during a final
    validation, the same command continues it to the report of an uninterrupted study."""

    def args(root: Path, *extra: str) -> list[str]:
        return [
            "--config", str(Path(__file__).parents[1] / "configs" / "synthetic_retrieval_gpu.yaml"),
            "--out_dir", str(root / "report"), "--task.train_min", "64", "--task.train_max", "64",
            "--task.eval_lengths", "[64,96]", "--task.test_size", "2", "--task.depths", "[0.0,1.0]",
            "--task.val_size", "8", "--schemes", "[alibi]", "--run.model.block_size", "64",
            "--run.model.n_layer", "1", "--run.model.n_head", "2", "--run.model.n_embd", "32",
            "--run.train.compile", "false",
            "--run.train.max_steps", "4", "--run.train.eval_interval", "4", "--run.train.batch_size", "4",
            "--run.train.logger", "none", *extra,
        ]  # fmt: skip

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    cli.run(synthetic.COMMAND, args(straight))
    assert "Plan: 2 training run(s)" in capsys.readouterr().out
    err = exits_with(capsys, synthetic.COMMAND, args(stopped, "--max_minutes", "0.02"), 75)
    assert "Time limit" in err and "Run the same command again" in err
    with monkeypatch.context() as patch:
        signal_during(patch, "validation_step", "drope-seed1337", step=4)
        err = exits_with(capsys, synthetic.COMMAND, args(stopped), 143)
    assert "during validation (run 2 of 2, drope-seed1337)" in err
    cli.run(synthetic.COMMAND, args(stopped))
    assert comparable_report(stopped / "report", stopped) == comparable_report(straight / "report", straight)


def test_the_retrieval_recipe_tests_at_1_2_4_and_8_times_the_training_length():
    config = cli.parse(synthetic.COMMAND, ["--config", str(Path(__file__).parents[1] / "configs" /
                                                              "synthetic_retrieval_gpu.yaml")])  # fmt: skip
    task = config.task
    assert task.name == "passkey" and task.eval_lengths == [n * task.train_max for n in (1, 2, 4, 8)]
    assert [m.name for m in config.models()] == ["learned", "sinusoidal", "rope", "alibi", "t5", "none", "drope"]


@pytest.mark.parametrize("name", ["synthetic_copy.yaml", "synthetic_passkey.yaml", "synthetic_copy_gpu.yaml"])
def test_shipped_synthetic_configs_parse(name):
    config = cli.parse(synthetic.COMMAND, ["--config", str(Path(__file__).parents[1] / "configs" / name)])
    assert config.schemes == ["learned", "sinusoidal", "rope", "alibi", "t5", "none"]
    assert max(config.task.eval_lengths) >= 8 * config.task.train_max  # test at 8x the training length or more
    assert any(variant.train.get("random_positions") for variant in config.models())


def _depth_grid(doc: dict) -> list[list[float]]:
    """Each model's mean accuracy per (depth, length) cell, depth by depth, as the depth figure prints them."""
    grids = []
    for label in dict.fromkeys(run["label"] for run in doc["runs"]):
        results = [r for run in doc["runs"] if run["label"] == label for r in run["results"]]
        grids.append([sum(v := [r["accuracy"] for r in results if r["length"] == n and r["depth"] == d]) / len(v)
                      for d in doc["task"]["depths"] for n in doc["task"]["eval_lengths"]])  # fmt: skip
    return grids
