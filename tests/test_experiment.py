"""`posgpt study extrapolation`: a tiny experiment end to end with the shipped CPU config
shrunk from the command line, run reuse, and the configs in configs/ parse."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from posgpt.core import cli
from posgpt.experiments import extrapolation as experiment

from helpers import cli_error, comparable_report, exits_with, signal_during

ROOT = Path(__file__).resolve().parents[1]


def _tiny(tmp_path: Path, text_file: Path, *extra: str) -> list[str]:
    return [
        "--config", str(ROOT / "configs" / "extrapolation_shakespeare.yaml"),
        "--out_dir", str(tmp_path / "report"),
        "--schemes", "[rope, learned]", "--variants", "[]",
        "--seeds", "[1, 2]",
        "--run.data.input", str(text_file),
        "--run.data.prepared_root", str(tmp_path / "prepared"),
        "--run.model.block_size", "16", "--run.model.n_layer", "1", "--run.model.n_embd", "32",
        "--run.train.max_steps", "8", "--run.train.eval_interval", "8", "--run.train.logger", "none",
        "--eval.lengths", "[8, 16, 32]", "--eval.token_budget", "64", "--eval.progress", "false",
        *extra,
    ]  # fmt: skip


VARIANTS = ("[{name: rope-w8, model: {pos_encoding: rope, attn_window: 8, attn_sinks: 2}}, "
            "{name: drope, model: {pos_encoding: rope}, train: {switch_at: 0.75, "
            "switch_model: {pos_encoding: none, attn_log_scaling: fixed}}}]")  # fmt: skip


def test_a_tiny_experiment_end_to_end_with_variants_beside_the_schemes_and_reuse(tmp_path, text_file, capsys, caplog):
    """Named variants (RoPE with a window and sinks; dropped positions: RoPE, then none with the log-length
    temperature from step 6 of 8) train and are evaluated like the schemes, over two seeds; a second launch
    reuses the runs it asks for and only evaluates."""
    with caplog.at_level(logging.INFO):
        cli.run(experiment.COMMAND, _tiny(tmp_path, text_file, "--schemes", "[learned]", "--variants", VARIANTS))
    lines = caplog.messages  # a study's progress: the plain lines of a run's steps, one per run and step
    assert "run 1/6 | training learned-seed1" in lines and sum(m.startswith("Reusing prepared/") for m in lines) <= 1
    done = r"run 5/6 \| rope-w8-seed2 trained in \d+:\d\d \| 1 left \| ETA \d+:\d\d"
    assert any(re.fullmatch(done, m) for m in lines)
    assert not any("no checkpoint in" in m for m in lines)  # a study's fresh run is no news
    report = tmp_path / "report"
    for name in ("results.json", "results.md", "ppl_vs_length.png", "loss_by_position.png", "experiment.yaml"):
        assert (report / name).stat().st_size > 0
    for run in ("learned-seed1", "learned-seed2", "rope-w8-seed1", "rope-w8-seed2", "drope-seed1", "drope-seed2"):
        assert (report / "runs" / run / "last.ckpt").is_file()
    doc = json.loads((report / "results.json").read_text())
    labels = [run["label"] for run in doc["runs"]]
    assert labels.count("learned") == 2 and labels.count("rope-w8") == 2 and labels.count("rope-w8 + yarn") == 2
    assert labels.count("drope") == 2 and "drope + yarn" not in labels  # no RoPE left to scale
    assert {run["seed"] for run in doc["runs"]} == {1, 2}
    assert len(doc["experiment"]["train_wall_s"]) == 6
    table = capsys.readouterr().out
    learned = next(line for line in table.splitlines() if line.startswith("| learned |"))
    assert learned.endswith("| n/a |") and "±" in learned  # two seeds: mean ± std; 32 > block_size 16
    windowed = [run["config"]["model"] for run in doc["runs"] if run["label"] == "rope-w8"]
    assert len({json.dumps(model, sort_keys=True) for model in windowed}) == 1  # the seeds share one model config
    assert (windowed[0]["attn_window"], windowed[0]["attn_sinks"], windowed[0]["pos_encoding"]) == (8, 2, "rope")
    drope = [run for run in doc["runs"] if run["label"] == "drope"]
    assert all(row["ppl"] for run in drope for row in run["results"])  # past block_size too

    # evaluation only: the runs of a model the study still has are reused, here those of the scheme alone
    cli.run(experiment.COMMAND, _tiny(tmp_path, text_file, "--schemes", "[learned]", "--eval.lengths", "[16, 32]"))
    again = json.loads((report / "results.json").read_text())
    assert again["experiment"]["train_wall_s"] == {} and again["settings"]["lengths"] == [16, 32]
    assert [run["label"] for run in again["runs"]] == ["learned", "learned"]
    argv = _tiny(tmp_path, text_file, "--schemes", "[rope]", "--variants", "[{name: rope}]")
    assert "must not repeat" in cli_error(capsys, experiment.COMMAND, argv)


def _recipe(root: Path, text_file: Path) -> list[str]:
    """The 124M GPU recipe shrunk to seconds on a CPU: one layer, char level, two schemes."""
    return [
        "--config", str(ROOT / "configs" / "extrapolation_124m.yaml"),
        "--out_dir", str(root / "report"), "--schemes", "[rope, learned]",
        "--run.data.input", str(text_file), "--run.data.tokenizer", "char",
        "--run.data.prepared_root", str(root / "prepared"),
        "--run.model.block_size", "16", "--run.model.n_layer", "1", "--run.model.n_head", "2",
        "--run.model.n_embd", "32", "--run.train.compile", "false", "--run.train.batch_size", "8",
        "--run.train.max_steps", "8", "--run.train.eval_interval", "4", "--run.train.ckpt_interval", "100",
        "--run.optim.warmup_steps", "2", "--run.train.logger", "none", "--eval.lengths", "[8, 16, 32]",
        "--eval.token_budget", "64", "--eval.progress", "false",
    ]  # fmt: skip


def test_a_study_killed_in_training_resumes_to_the_same_report(tmp_path, text_file, monkeypatch, capsys):
    """Killed (a real SIGTERM) while its second run trains, the same command continues it, to the report of an
    uninterrupted study (wall times aside). (Killed during a validation: test_synthetic.py's study.)"""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    cli.run(experiment.COMMAND, _recipe(straight, text_file))
    plan = capsys.readouterr().out
    assert "Plan: 2 training run(s) on cpu" in plan and "Estimated training time" in plan
    with monkeypatch.context() as patch:
        signal_during(patch, "training_step", "learned-seed1337", step=2)
        err = exits_with(capsys, experiment.COMMAND, _recipe(killed, text_file), 143)
    assert "Stopped by SIGTERM at step 3 (run 2 of 2, learned-seed1337). Run the same command again" in err
    cli.run(experiment.COMMAND, _recipe(killed, text_file))
    out = capsys.readouterr().out
    assert "1. rope-seed1337" in out and "(trained, reused)" in out and "(resumes at step 3)" in out
    assert comparable_report(killed / "report", killed) == comparable_report(straight / "report", straight)
    table = (killed / "report" / "results.md").read_text()
    assert "each run: 8 steps" in table and "training wall time" in table
    assert {"attention_L8.png", "ppl_vs_length.png"} <= {p.name for p in (killed / "report").iterdir()}


def test_the_124m_recipe_is_the_papers_grid():
    config = cli.parse(experiment.COMMAND, ["--config", str(ROOT / "configs" / "extrapolation_124m.yaml")])
    assert config.schemes == ["learned", "sinusoidal", "rope", "alibi", "t5", "none"] and config.variants == []
    model = config.run.model
    assert (model.n_layer, model.n_head, model.n_embd, model.block_size) == (12, 12, 768, 512)
    assert config.run.data.tokenizer == "gpt2" and config.run.data.input == "python-library"
    assert max(config.eval.lengths) == 16 * model.block_size and config.eval.attention_stats
    assert config.eval.rope_scaling == ["none", "linear", "ntk", "yarn"]


@pytest.mark.parametrize("name", ["extrapolation_shakespeare.yaml", "extrapolation_gpu.yaml"])
def test_shipped_experiment_configs_parse(name):
    config = cli.parse(experiment.COMMAND, ["--config", str(ROOT / "configs" / name)])
    assert config.schemes == ["learned", "sinusoidal", "rope", "alibi", "t5", "kerple", "fire", "none"]
    variants = {variant.name: variant for variant in config.models()}
    assert variants["drope"].train["switch_model"]["pos_encoding"] == "none"  # dropped positions: one line
    assert any(variant.model.get("attn_window", 0) > 0 for variant in config.models())  # a sliding-window model
    assert max(config.eval.lengths) >= 8 * config.run.model.block_size  # train short, test at 8x or more
    assert config.eval.mode == "nonoverlap"


def test_only_picks_models_by_name_and_a_misspelled_one_gets_the_closest(capsys):
    """Issue 57: no way to pick a few of extrapolation_layouts' seven models; the user retyped one as --variants."""
    argv = ["--config", "configs/extrapolation_layouts.yaml", "--only", "rope", "gemma3", "hybrid"]
    config = cli.parse(experiment.COMMAND, argv)
    assert [m.name for m in config.models()] == ["rope", "hybrid", "gemma3"]  # in the config's order
    assert config.models()[2].model["kinds"]["global"] == {"rope_base": 1000000.0}
    message = cli_error(capsys, experiment.COMMAND, [*argv[:3], "hybird"])
    assert message == (
        "error: --only hybird: no such model; the models are rope, none, hybrid, irope, gemma3, rope-gate, "
        "rope-sinklogits; did you mean hybrid?"
    )


def test_experiment_config_mistakes_fail_clearly(tmp_path, text_file, capsys):
    assert "must not repeat" in cli_error(capsys, experiment.COMMAND, _tiny(tmp_path, text_file, "--seeds", "[1, 1]"))
    message = cli_error(capsys, experiment.COMMAND, _tiny(tmp_path, text_file, "--schemes", "[rope, t7]"))
    assert "t7" in message and "pos_encoding" in message  # the config names the field and the choices
    old_format = _tiny(tmp_path, text_file, "--variants", "[{name: w8, pos_encoding: rope, attn_window: 8}]")
    with pytest.raises(SystemExit) as info:  # a variant as experiment files wrote them before issue 20
        cli.run(experiment.COMMAND, old_format)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "under model:" in err, err
    assert not (tmp_path / "report").exists()


def test_the_new_schemes_and_switches_are_taken_by_name_and_as_variants(tmp_path, text_file):
    """Kerple and FIRE by name; partial RoPE, log-n scaling, the general score, sigmoid and differential
    attention and BigBird's mask as variants (issue 23); DroPE trains in the end-to-end test above."""
    variants = (
        "[{name: p-rope, model: {pos_encoding: rope, rope_fraction: 0.5}}, "
        "{name: nope-logn, model: {pos_encoding: none, attn_log_scaling: learned}}, "
        "{name: rope-general, model: {pos_encoding: rope, attn_score: general}}, "
        "{name: sigmoid, model: {attention: sigmoid}}, {name: diff, model: {attention: differential}}, "
        "{name: bigbird, model: {attn_window: 4, attn_sinks: 1, attn_random_blocks: 1, attn_sparse_block: 4}}]"
    )
    config = cli.parse(experiment.COMMAND, _tiny(tmp_path, text_file, "--schemes", "[kerple, fire]",
                                                 "--variants", variants))  # fmt: skip
    names = ["kerple", "fire", "p-rope", "nope-logn", "rope-general", "sigmoid", "diff", "bigbird"]
    assert [m.name for m in config.models()] == names
    assert config.eval.attention_stats  # the study explains its curves by default (sink rate included)


def test_a_variant_with_a_fraction_that_makes_no_whole_pairs_is_refused_before_training(tmp_path, text_file, capsys):
    bad = _tiny(
        tmp_path, text_file, "--variants", "[{name: p-rope-bad, model: {pos_encoding: rope, rope_fraction: 0.3}}]"
    )
    message = cli_error(capsys, experiment.COMMAND, bad)
    assert "p-rope-bad" in message and "rope_fraction 0.3" in message
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize(("config", "named"), [("extrapolation_shakespeare", True), ("extrapolation_quick", False)])
def test_a_plan_of_hours_on_a_cpu_names_the_quick_study(config, named, tmp_path, text_file, monkeypatch, capsys):
    """The README's full study on a CPU is many hours: its plan says so before anything is prepared, and names
    the five-minute one; the quick one's plan, long on a slow CPU, names the options that train less instead."""
    from posgpt.training import run

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "prepared_data", stop)
    monkeypatch.setattr(
        "posgpt.experiments.common.sustained_flops", lambda device, precision: 3e8
    )  # a slow CPU: both past an hour
    argv = ["--config", f"configs/{config}.yaml", "--out_dir", str(tmp_path), "--run.data.input", str(text_file),
            "--run.train.accelerator", "cpu"]  # fmt: skip
    with pytest.raises(SystemExit):
        cli.run(experiment.COMMAND, argv)
    plan = capsys.readouterr().out
    quick = "That is long for a CPU: --config configs/extrapolation_quick.yaml is a first study in about 5 minutes"
    options = "That is long for a CPU: fewer models or seeds (--only, --seeds) or steps"
    assert (quick in plan) is named and (options in plan) is not named  # the quick study never names itself
    assert "--max_minutes N" in plan
