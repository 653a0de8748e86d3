"""Context extension (`init_from` a posgpt checkpoint at another block_size; `extend` in the extrapolation study):
the weights loaded exactly, the original length what PI, NTK and YaRN scale from (against the float64 formula),
the optimizer, schedule and data started afresh, the fine-tune resumed exactly, a kind that pins no scaling left
turning as it did, and what cannot be extended refused in one line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_text

import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.core.errors import ConfigError
from posgpt.evaluation.checkpoint import load_checkpoint
from posgpt.evaluation.run import at_length
from posgpt.experiments import extrapolation
from posgpt.experiments.common import run_config_for
from posgpt.model import GPT, GPTConfig
from posgpt.training.config import RunConfig
from posgpt.training.run import fine_tune_start, train

from helpers import cli_error

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = "{local: {attn_window: 8, rope_scaling: none}, global: {}}"
STEPS = 4


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[extrapolation.ExperimentConfig, Path]:
    """A learned-position model and a RoPE layout (its local kind pins rope_scaling none) trained at 16, and the
    RoPE one fine-tuned at 4x without scaling, with YaRN and as DroPE (the learned one is not extended: its table
    ends)."""
    root = tmp_path_factory.mktemp("extension")
    (root / "corpus.txt").write_text(make_text(), encoding="utf-8")
    argv = ["--config", str(ROOT / "configs" / "extrapolation_quick.yaml"), "--out_dir", str(root / "report"),
            "--schemes", "[learned]", "--seeds", "[1]",
            "--variants", f"[{{name: rope, model: {{pos_encoding: rope, layout: [local, global], kinds: {LAYOUT}}}}}]",
            "--run.data.input", str(root / "corpus.txt"), "--run.data.prepared_root", str(root / "prepared"),
            "--run.model.block_size", "16", "--run.model.n_layer", "2", "--run.model.n_embd", "32",
            "--run.train.max_steps", "6", "--run.train.eval_interval", "6", "--run.train.batch_size", "4",
            "--run.train.logger", "none", "--eval.lengths", "[16, 64, 128]", "--eval.token_budget", "64",
            "--eval.progress", "false", "--eval.rope_scaling", "[none, yarn]",
            "--extend", f"{{factor: 4, methods: [none, yarn, drope], train: {{max_steps: {STEPS}, "
                        f"eval_interval: {STEPS}}}, "
                        "optim: {lr: 1.0e-3}}"]  # fmt: skip
    cli.run(extrapolation.COMMAND, argv)
    return cli.parse(extrapolation.COMMAND, argv), root


def test_the_study_fine_tunes_each_model_from_its_own_checkpoint_with_each_method(study):
    cfg, root = study
    assert [m.name for m in cfg.models()] == ["learned", "rope", "rope-x4-none", "rope-x4-yarn", "rope-x4-drope"]
    yarn = run_config_for(cfg.run, cfg.out_dir, cfg.models()[3], 1)
    assert yarn.model.init_from == str(root / "report" / "runs" / "rope-seed1" / "last.ckpt")
    assert (yarn.model.block_size, yarn.model.original_block_size) == (64, 16)
    assert (yarn.model.rope_scaling, yarn.model.rope_scaling_factor, yarn.optim.lr) == ("yarn", 4.0, 1e-3)
    unscaled = run_config_for(cfg.run, cfg.out_dir, cfg.models()[2], 1).model  # its rotation is native to 64
    assert (unscaled.block_size, unscaled.original_block_size, unscaled.original_length) == (64, None, 64)
    drope = load_checkpoint(root / "report" / "runs" / "rope-x4-drope-seed1" / "last.ckpt").model.config
    assert (drope.pos_encoding, drope.attn_log_scaling, drope.block_size) == ("none", "fixed", 64)
    labels = {run["label"] for run in json.loads((root / "report" / "results.json").read_text())["runs"]}
    assert {"rope-x4-none", "rope-x4-none + yarn", "rope-x4-yarn", "rope-x4-yarn + yarn", "rope-x4-drope"} <= labels
    assert not any(label.startswith("learned-x") for label in labels)
    assert "| rope-x4-yarn | rope, local-global, yarn x4 |" in (root / "report" / "results.md").read_text()


def test_the_weights_load_exactly_and_optimizer_schedule_and_data_start_afresh(study):
    cfg, root = study
    runs = root / "report" / "runs"
    base = load_checkpoint(runs / "rope-seed1" / "last.ckpt")
    fine = run_config_for(cfg.run, cfg.out_dir, cfg.models()[3], 1).model
    start = fine_tune_start(dataclasses.replace(fine, vocab_size=base.tokenizer.vocab_size), base.tokenizer)
    for name, tensor in base.model.state_dict().items():
        assert torch.equal(start.state_dict()[name], tensor), name
    ckpt = read_checkpoint(runs / "rope-x4-yarn-seed1" / "last.ckpt")
    assert ckpt["global_step"] == STEPS and ckpt["tokens_seen"] == STEPS * 4 * 64  # counted from 0, not from 6
    assert {float(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()} == {STEPS}
    assert ckpt["lr_schedulers"][0]["last_epoch"] == STEPS
    assert ckpt["hyper_parameters"]["config"]["model"]["original_block_size"] == 16


def test_a_fine_tune_resumes_exactly_without_its_starting_checkpoint(study):
    cfg, root = study
    fine = run_config_for(cfg.run, str(root / "split"), cfg.models()[3], 1)
    base = str(root / "report" / "runs" / "rope-seed1" / "last.ckpt")  # the study's, not one under split/
    fine = dataclasses.replace(fine, model=dataclasses.replace(fine.model, init_from=base))
    train(dataclasses.replace(fine, train=dataclasses.replace(fine.train, max_steps=STEPS // 2, resume=None)))
    gone = dataclasses.replace(fine.model, init_from=str(root / "gone.ckpt"), original_block_size=None)  # as typed
    train(dataclasses.replace(fine, model=gone, train=dataclasses.replace(fine.train, max_steps=STEPS, resume="auto")))
    split = read_checkpoint(root / "split" / "runs" / "rope-x4-yarn-seed1" / "last.ckpt")["state_dict"]
    straight = read_checkpoint(root / "report" / "runs" / "rope-x4-yarn-seed1" / "last.ckpt")["state_dict"]
    assert split.keys() == straight.keys()
    for name, tensor in straight.items():
        assert torch.equal(split[name], tensor), name


def test_a_kind_that_pins_no_scaling_keeps_its_rotation_after_the_fine_tune(study):
    _, root = study
    tuned = load_checkpoint(root / "report" / "runs" / "rope-x4-yarn-seed1" / "last.ckpt").model
    local, global_ = (tuned.pe_of(kind).rotation(96) for kind in tuned.kinds)
    plain = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, pos_encoding="rope")
    torch.testing.assert_close(local, GPT(plain).pe.rotation(96), rtol=0, atol=0)
    yarn = dataclasses.replace(plain, block_size=64, original_block_size=16, rope_scaling="yarn", rope_scaling_factor=4)
    torch.testing.assert_close(global_, GPT(yarn).pe.rotation(96), rtol=0, atol=0)


def _angles64(scaling: str, length: int, dim: int, base: float, factor: float, original: int) -> torch.Tensor:
    """cos of the scaled RoPE angles in float64, from the papers' formulas (PI: theta / s; NTK: base s^(D/(D-2));
    YaRN: the ramp between the pairs turning 32 and 1 times within the original length, times 0.1 ln s + 1)."""
    base = base * factor ** (dim / (dim - 2)) if scaling == "ntk" else base
    theta = [base ** (-2 * i / dim) for i in range(dim // 2)]
    scale = 1.0
    if scaling == "linear":
        theta = [t / factor for t in theta]
    if scaling == "yarn":
        turning = [dim * math.log(original / (r * 2 * math.pi)) / (2 * math.log(base)) for r in (32, 1)]
        low, high = max(math.floor(turning[0]), 0), min(math.ceil(turning[1]), dim - 1)
        ramp = [min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0) for i in range(dim // 2)]
        theta = [t * (1 - w) + t / factor * w for t, w in zip(theta, ramp, strict=True)]
        scale = 0.1 * math.log(factor) + 1
    return scale * torch.cos(torch.arange(length, dtype=torch.float64)[:, None] * torch.tensor(theta)[None])


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_the_original_length_is_what_the_scalings_stretch_from(scaling):
    """A model fine-tuned at 64 from 16 turns as the formula with L0 = 16, not its block_size (YaRN's ramp moves:
    pairs 0-2 at 16, 0-5 at 64); `posgpt evaluate`'s dynamic factor divides by 16 too."""
    config = GPTConfig(vocab_size=64, block_size=64, original_block_size=16, n_layer=1, n_head=2, n_embd=64,
                       pos_encoding="rope", rope_scaling=scaling, rope_scaling_factor=4.0)  # fmt: skip
    model = GPT(config)
    cos = model.pe.rotation(200)[:, 0, 0].double()
    torch.testing.assert_close(cos, _angles64(scaling, 200, 32, 1e4, 4.0, 16), rtol=0, atol=2e-5)
    if scaling == "yarn":
        assert not torch.allclose(cos, _angles64(scaling, 200, 32, 1e4, 4.0, 64), atol=1e-2)
    assert at_length(model, "yarn", "dynamic", 128).config.rope_scaling_factor == 8.0
    assert at_length(model, "yarn", "dynamic", 32).config.rope_scaling_factor == 4.0  # never less than it trained at


def test_what_cannot_be_extended_is_refused_in_one_line(study, capsys):
    _, root = study
    runs, other = root / "report" / "runs", root / "other.txt"
    other.write_text("abc\n" * 300, encoding="utf-8")
    common = ["--data.prepared_root", str(root / "prepared"), "--train.out_dir", str(root / "refused"),
              "--train.max_steps", "2", "--model.block_size", "64"]  # fmt: skip
    learned = ["--config", str(runs / "learned-seed1" / "config.yaml"), *common,
               "--model.init_from", str(runs / "learned-seed1" / "last.ckpt")]  # fmt: skip
    line = cli_error(capsys, train_script.COMMAND, learned)
    assert "has 16 learned positions: pass --model.block_size 16 or less, or another --model.pos_encoding" in line
    rope = ["--config", str(runs / "rope-seed1" / "config.yaml"), *common]
    line = cli_error(capsys, train_script.COMMAND, [*rope, "--model.init_from", str(runs / "rope-seed1" / "last.ckpt"),
                                                    "--data.input", str(other)])  # fmt: skip
    assert "reads text with its own tokenizer (char, " in line and "the data's is another" in line
    line = cli_error(capsys, train_script.COMMAND, [*rope, "--model.init_from", str(root / "none.ckpt")])
    assert "none.ckpt: no such checkpoint file, nor a directory or a name of GPT-2's weights" in line
    assert not list((root / "refused").glob("*/*"))  # nothing written for a start refused
    pi = ["--model.rope_scaling", "linear", "--model.rope_scaling_factor", "4", "--train.out_dir", str(root / "pi")]
    cli.run(train_script.COMMAND, [*rope, *pi, "--model.init_from", str(runs / "rope-seed1" / "last.ckpt")])
    assert read_checkpoint(root / "pi" / "rope-seed1" / "last.ckpt")["model_config"]["original_block_size"] == 16


def test_the_study_extends_what_each_model_ends_as():
    """A model switched mid-training (DroPE's variant) is fine-tuned as the NoPE model it became, with its log
    scaling, and does not switch again; CoPE keeps its count table's size; `--only` a fine-tune trains its model
    too; `extends` names a model listed before."""
    argv = ["--config", str(ROOT / "configs" / "extrapolation_quick.yaml"), "--schemes", "[cope]",
            "--variants", "[{name: drope, model: {pos_encoding: rope}, train: {switch_at: 0.5, switch_model: "
                          "{pos_encoding: none, attn_log_scaling: fixed}}}]",
            "--extend", "{factor: 2, methods: [none, yarn]}"]  # fmt: skip
    cfg = cli.parse(extrapolation.COMMAND, argv)
    models = {m.name: m for m in cfg.models()}
    assert list(models) == ["cope", "drope", "cope-x2-none", "drope-x2-none"]  # no RoPE left to scale in drope
    fine = run_config_for(cfg.run, ".", models["drope-x2-none"], 1)
    assert (fine.model.pos_encoding, fine.model.attn_log_scaling, fine.train.switch_at) == ("none", "fixed", 0.0)
    cope = run_config_for(cfg.run, ".", models["cope-x2-none"], 1).model
    assert (cope.block_size, cope.cope_positions) == (256, 129)
    only = cli.parse(extrapolation.COMMAND, [*argv, "--only", "[drope-x2-none]"])
    assert [m.name for m in only.models()] == ["drope", "drope-x2-none"]
    with pytest.raises(ConfigError, match="late: extends 'drope', which is not a model listed before it"):
        cli.parse(extrapolation.COMMAND, [*argv, "--variants", "[{name: late, extends: drope}, {name: drope}]"])


def test_a_kind_that_scales_rope_counts_and_an_unscaled_model_has_no_original_length():
    kinds = {"local": {"attn_window": 4, "rope_scaling": "none"}, "global": {"rope_scaling": "yarn"}}
    olmo = GPTConfig(block_size=64, n_layer=2, pos_encoding="rope", layout=("local", "global"), kinds=kinds)
    assert olmo.scales_rope and dataclasses.replace(olmo, original_block_size=16).original_length == 16
    assert not dataclasses.replace(olmo, kinds={**kinds, "global": {}}).scales_rope
    with pytest.raises(ValueError, match="original_block_size is the length a rope_scaling stretches from"):
        RunConfig(model=GPTConfig(block_size=64, pos_encoding="rope", original_block_size=16))
