"""Switching a model's position scheme mid-training (`GPT.switch`, `train.switch_at`), the mechanism
behind dropping positions (DroPE): the switched model is the new config's model with the same weights,
the optimizer keeps its state for every parameter that stays, checkpoints hold the switched model,
and a run resumed before or after the switch ends bit for bit where an uninterrupted one does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.evaluation.checkpoint import load_checkpoint
from posgpt.model import GPT, GPTConfig
from posgpt.training.config import RunConfig, TrainConfig

from helpers import cli_error, tiny_args

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False, pos_encoding="rope")
LAYOUT = {"layout": ("a", "b"), "kinds": {"a": {"pos_encoding": "t5"}, "b": {}}}
DROPE = ("--train.switch_model", "{pos_encoding: none, attn_log_scaling: fixed}")


@pytest.mark.parametrize(
    "changes",
    [{"pos_encoding": "none", "attn_log_scaling": "fixed"}, {"pos_encoding": "alibi", "attn_window": 8},
     {"pos_encoding": "t5", "attn_log_scaling": "learned"}],
    ids=["drope", "alibi-window", "t5-learned-scale"],
)  # fmt: skip
def test_a_switched_model_is_the_new_configs_model_with_the_same_weights(changes):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    kept = {name: p for name, p in model.named_parameters() if not name.startswith("pe.")}
    target = dataclasses.replace(CONFIG, **changes)
    model.switch(target)
    assert model.config == target
    assert all(p is dict(model.named_parameters())[name] for name, p in kept.items())  # the optimizer's objects
    fresh = GPT(target)
    fresh.load_state_dict(model.state_dict())  # strict: the same parameters and buffers
    idx = torch.randint(0, 64, (2, 24))
    torch.testing.assert_close(model(idx)[0], fresh(idx)[0])


def test_a_switch_that_would_change_the_blocks_is_refused():
    with pytest.raises(ValueError, match="not n_layer"):
        GPT(CONFIG).switch(dataclasses.replace(CONFIG, n_layer=3))
    with pytest.raises(ValueError, match="train.switch_model cannot change attention"):
        RunConfig(train=TrainConfig(switch_at=0.5, switch_model={"attention": "linear"}))
    with pytest.raises(ValueError, match="train.switch_at and train.switch_model go together"):
        TrainConfig(switch_at=0.5)
    with pytest.raises(ValueError, match="is step 0"):
        RunConfig(train=TrainConfig(max_steps=10, switch_at=0.01, switch_model={"pos_encoding": "none"}))
    with pytest.raises(ValueError, match="train.switch_model: GPTConfig.pos_encoding must be one of"):
        RunConfig(train=TrainConfig(switch_at=0.5, switch_model={"pos_encoding": "rotary"}))
    assert TrainConfig(max_steps=200, switch_at=0.85, switch_model={"pos_encoding": "none"}).switch_step() == 170


def _train(directory, text_file, steps: int, *extra: str, resume: bool = False) -> dict:
    argv = tiny_args(
        directory,
        text_file,
        "--train.max_steps",
        str(steps),
        "--train.ckpt_interval",
        "2",
        "--optim.decay_steps",
        "10",
        *extra,
    )  # one schedule, whatever the run stops at
    cli.run(train_script.COMMAND, [*argv, *(["--train.resume", "auto"] if resume else [])])
    return read_checkpoint(directory / "runs" / "tiny" / "last.ckpt")


@pytest.mark.parametrize("switch", [DROPE, ("--train.switch_model", "{pos_encoding: t5, attn_log_scaling: learned}")],
                         ids=["drope", "new-parameters"])  # fmt: skip
def test_resumed_before_and_after_the_switch_a_run_ends_where_an_uninterrupted_one_does(
    tmp_path, text_file, switch, capsys
):
    """One run stopped before the switch (at 4), resumed, stopped after it (at 8) and resumed again ends bit
    for bit where an uninterrupted one does; a switched run resumed with another switch is refused."""
    extra = ("--train.switch_at", "6", *switch)
    straight = _train(tmp_path / "straight", text_file, 10, *extra)
    assert straight["switched_at"] == 6
    # AdamW carried its moments across the switch: 10 steps for the kept parameters, 4 for new ones
    steps = {int(state["step"]) for state in straight["optimizer_states"][0]["state"].values()}
    assert steps == ({10} if switch == DROPE else {4, 10})
    split = tmp_path / "split"
    assert _train(split, text_file, 4, *extra)["switched_at"] is None  # stopped before the switch
    switched = _train(split, text_file, 8, *extra, resume=True)  # resumed before the switch, stopped after it
    assert switched["switched_at"] == 6
    if switch == DROPE:
        argv = tiny_args(split, text_file, "--train.max_steps", "10", "--train.switch_at", "6",
                         "--train.switch_model", "{pos_encoding: alibi}", "--train.resume", "auto")  # fmt: skip
        assert "switched to {'pos_encoding': 'none', 'attn_log_scaling': 'fixed'} at step 6" in cli_error(
            capsys, train_script.COMMAND, argv
        )
    resumed = _train(split, text_file, 10, *extra, resume=True)  # resumed after the switch
    assert resumed["switched_at"] == 6 and resumed["model_config"] == straight["model_config"]
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], tensor), name
    loaded = load_checkpoint(tmp_path / "straight" / "runs" / "tiny" / "last.ckpt")
    assert loaded.model.config.pos_encoding == ("none" if switch == DROPE else "t5")
    assert loaded.model.config.attn_log_scaling != "none"


@pytest.mark.parametrize(
    ("start", "switch", "replaces"),
    [({}, {"pos_encoding": "t5"}, True), ({"pos_encoding": "t5"}, {"pos_encoding": "none"}, True),
     ({}, {"pos_encoding": "none"}, False), (LAYOUT, {"pos_encoding": "none"}, False),
     (LAYOUT, {"pos_encoding": "fire"}, True), (LAYOUT, {"attn_log_scaling": "learned"}, True)],
    ids=["gains", "drops", "neither", "kind-keeps-its-own", "kind-follows", "log-scale"],
)  # fmt: skip
def test_a_switch_is_said_to_replace_parameters_exactly_when_it_does(start, switch, replaces):
    """What a run on several devices asks before the switch (`switch_replaces_parameters`), against the switch: a
    scheme with parameters that comes or goes, the model's or a kind's (a kind that pins its own keeps it)."""
    model = GPT(dataclasses.replace(CONFIG, **start))
    target = dataclasses.replace(model.config, **switch)
    assert model.switch_replaces_parameters(target) == replaces
    before = {id(p) for p in model.parameters()}
    model.switch(target)
    assert ({id(p) for p in model.parameters()} != before) == replaces


def test_a_switch_that_adds_parameters_is_refused_on_several_devices():
    from types import SimpleNamespace

    from posgpt.core.errors import ConfigError
    from posgpt.training.module import GPTModule

    for changes, refused in (({"pos_encoding": "t5"}, True), ({"pos_encoding": "none", "attn_log_scaling": "fixed"},
                                                                False)):  # fmt: skip
        cfg = RunConfig(model=CONFIG, train=TrainConfig(switch_at=0.5, switch_model=changes))
        module = GPTModule(cfg, {}, {})
        module._trainer = SimpleNamespace(world_size=2)
        if refused:
            with pytest.raises(ConfigError, match="replaces parameters, which a run on 2 devices cannot"):
                module.on_train_start()
        else:
            module.on_train_start()


def test_a_compiled_model_follows_its_switch():
    """train.compile compiles the model in place: after a switch the graph is traced anew (dynamo's
    guards see the new scheme), never the old scheme's graph run on the new model. One layer: two traces."""
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, n_layer=1)
    model = GPT(config)
    model.compile(backend="eager")
    idx = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        before = model(idx)[0]
        target = dataclasses.replace(config, pos_encoding="alibi", attn_log_scaling="fixed")
        model.switch(target)
        after = model(idx)[0]
    fresh = GPT(target)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(after, fresh(idx)[0])
    assert not torch.allclose(after, before)
