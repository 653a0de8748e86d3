"""The data-dependent schemes (CoPE, forgetting and stick-breaking attention) from the command line: trained two
steps, sampled through the KV cache, attention maps drawn (heat maps and attention against distance); both
studies take them. Their formulas: test_cope.py, test_forgetting.py, test_stick_breaking.py."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import attention_maps as maps_script
import sample as sample_script
import train as train_script
from posgpt.core import cli

from helpers import tiny_args


def test_cope_with_stick_breaking_trains_two_steps_from_the_command_line_samples_and_draws_its_maps(
    tmp_path, text_file, capsys
):
    """Both on the eager kernel, in one model; forgetting attention's run from the command line is the study's
    (test_tasks.py), its weights those of `attention_weights` (test_forgetting.py)."""
    cli.run(train_script.COMMAND, tiny_args(tmp_path, text_file, "--model.attention", "stick_breaking",
                                            "--model.pos_encoding", "cope", "--train.max_steps", "2"))  # fmt: skip
    ckpt = tmp_path / "runs" / "tiny" / "last.ckpt"
    capsys.readouterr()
    cli.run(sample_script.COMMAND, ["--ckpt", str(ckpt), "--prompt", "The", "--max_new_tokens", "12", "--seed", "1"])
    assert capsys.readouterr().out.startswith("The")
    out = tmp_path / "maps"
    cli.run(maps_script.COMMAND, ["--ckpt", str(ckpt), "--prompt", "The king.", "--layers", "0", "--lengths", "16",
                                  "--tokens", "32", "--out", str(out), "--progress", "false"])  # fmt: skip
    doc = json.loads((out / "results.json").read_text())
    weights = torch.tensor(doc["prompts"][0]["weights"]["0"])  # (heads, T, T): each row sums to 1 (the remainder
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), rtol=1e-4, atol=1e-4)  # included)
    assert (out / "attention_L16.png").is_file() and doc["lengths"][0]["length"] == 16


@pytest.mark.parametrize("study", ["extrapolation", "synthetic"])
def test_both_studies_take_cope_by_name_and_the_two_functions_as_variants(study):
    command = importlib.import_module(f"posgpt.experiments.{study}").COMMAND
    variants = ("[{name: fox, model: {attention: forgetting, pos_encoding: none}}, "
                "{name: sb, model: {attention: stick_breaking, pos_encoding: none}}]")  # fmt: skip
    config = cli.parse(command, ["--schemes", "cope", "--variants", variants])
    assert [(m.name, m.model) for m in config.models()] == [
        ("cope", {"pos_encoding": "cope"}),
        ("fox", {"attention": "forgetting", "pos_encoding": "none"}),
        ("sb", {"attention": "stick_breaking", "pos_encoding": "none"}),
    ]
