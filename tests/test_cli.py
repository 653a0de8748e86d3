"""core.cli and every command through it: a user's mistake is one line on stderr and exit status 2,
a misspelled option a short usage with the closest option, list options take `--x a b` and
`--x [a,b]` alike, and the options that error messages name are options of the command that
prints them."""

from __future__ import annotations

import argparse
import dataclasses
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

import attention_maps
import bench
import evaluate
import sample
import train
from posgpt import cli as posgpt_cli
from posgpt.core import cli
from posgpt.core.errors import TrainingDiverged, TrainingStopped, UserError
from posgpt.core.modes import run_modes
from posgpt.data import prepare
from posgpt.experiments import extrapolation, synthetic

from helpers import cli_error, loaded

ROOT = Path(__file__).resolve().parents[1]
BENCH = loaded(bench.MODES)
COMMANDS = {
    "train.py": train.COMMAND,
    "sample.py": sample.COMMAND,
    "evaluate.py": evaluate.COMMAND,
    "attention_maps.py": attention_maps.COMMAND,
    "experiments.extrapolation": extrapolation.COMMAND,
    "experiments.synthetic": synthetic.COMMAND,
    "data.prepare": prepare.COMMAND,
}
SYNTHETIC = ["--config", str(ROOT / "configs" / "synthetic_copy.yaml")]


def _invoke(name: str, argv: list[str]) -> None:
    if name == "bench.py":
        run_modes("bench.py", bench.__doc__, bench.MODES, argv)
    else:
        cli.run(COMMANDS[name], argv)


def _stops(capsys, name: str, argv: list[str]) -> list[str]:
    """The lines on stderr of a command that must exit with status 2."""
    with pytest.raises(SystemExit) as info:
        _invoke(name, argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()


@pytest.mark.parametrize(
    ("name", "argv", "needle"),
    [
        ("train.py", ["--data.input", "{tmp}/nope.txt", "--data.prepared_root", "{tmp}/p", "--train.out_dir",
                      "{tmp}/runs"], "Input not found"),
        ("sample.py", ["--ckpt", "{tmp}/nope.ckpt"], "Checkpoint not found"),
        ("evaluate.py", ["--ckpt", "{tmp}/nope.ckpt", "--out", "{tmp}/e"], "Checkpoint not found"),
        ("attention_maps.py", ["--ckpt", "{tmp}/nope.ckpt", "--prompt", "a", "--out", "{tmp}/m"],
         "Checkpoint not found"),
        ("experiments.extrapolation", ["--out_dir", "{tmp}/r", "--variants", "{name: w, model: {attn_windw: 8}}"],
         "w: model has no field 'attn_windw'; did you mean model.attn_window?"),
        ("experiments.synthetic", [*SYNTHETIC, "--out_dir", "{tmp}/r", "--variants", "{name: r, train: {seed: 3}}"],
         "r: train.seed is set for every run"),
        ("data.prepare", ["--inputs", "{tmp}/nope.txt", "--out_dir", "{tmp}/p"], "Input not found"),
    ],
)  # fmt: skip
def test_a_user_error_is_one_line_and_exit_status_2(name, argv, needle, tmp_path, capsys):
    lines = _stops(capsys, name, [a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


@pytest.mark.parametrize(
    ("name", "argv", "closest"),
    [
        ("train.py", ["--model.pos_encodng", "rope"], "--model.pos_encoding"),
        ("train.py", ["--n_layer", "3"], "--model.n_layer"),  # a field without its group
        ("sample.py", ["--ckpt", "x", "--max_new_tokns", "5"], "--max_new_tokens"),
        ("evaluate.py", ["--ckpt", "x", "--eval.lenghts", "16", "32"], "--eval.lengths"),
        ("attention_maps.py", ["--ckpt", "x", "--lenghts", "16"], "--lengths"),
        ("experiments.extrapolation", ["--run.model.n_layr", "2"], "--run.model.n_layer"),
        ("experiments.synthetic", ["--task.nme", "copy"], "--task.name"),
        ("data.prepare", ["--inputs", "a", "--out_dirr", "x"], "--out_dir"),
        ("bench.py", ["decode", "--tokns", "5"], "--tokens"),
        ("bench.py", ["decod"], "decode"),
    ],
)
def test_a_misspelled_option_gets_a_short_usage_and_the_closest_option(name, argv, closest, capsys):
    lines = _stops(capsys, name, argv)
    assert lines[0].startswith("usage: ") and "--help" in lines[-1], lines
    assert any(f"did you mean {closest}?" in line for line in lines), lines


def test_a_misspelled_key_in_a_config_file_gets_the_closest_option(tmp_path, capsys):
    for text, closest in (
        ("model:\n  n_layr: 3\n", "--model.n_layer"),
        ("trian:\n  max_steps: 3\n", "--train.max_steps"),
    ):
        (tmp_path / "bad.yaml").write_text(text)
        lines = _stops(capsys, "train.py", ["--config", str(tmp_path / "bad.yaml")])
        assert f"did you mean {closest}?" in lines[1], lines


@pytest.mark.parametrize(
    ("name", "argv", "text", "holds"),
    [
        ("train.py", [], "- model\n- train\n", "a list"),
        ("train.py", [], "model\n", "a single value ('model')"),
        ("train.py", [], "# all commented out\n", "nothing"),
        *((name, [], "- model\n", "a list") for name in COMMANDS if name != "train.py"),
        ("bench.py", ["decode"], "[1, 2]\n", "a list"),
    ],
)
def test_a_config_file_that_is_not_a_mapping_is_one_error_naming_it(name, argv, text, holds, tmp_path, capsys):
    """Every command reads --config through `core.cli`: a list or a single value there used to end in
    'error: Unexpected config: - model' with the file's text on the lines below."""
    (tmp_path / "bad.yaml").write_text(text)
    lines = _stops(capsys, name, [*argv, "--config", str(tmp_path / "bad.yaml")])
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and len(lines) == 3, lines  # the usage line, the error, where --help is
    assert f"--config {tmp_path / 'bad.yaml'} holds {holds}, not a mapping: a config file maps" in errors[0]
    assert "--print_config` writes one" in errors[0]


def test_a_bad_value_is_a_short_usage_too(capsys):
    lines = _stops(capsys, "train.py", ["--model.n_layer", "four"])
    assert "model.n_layer" in lines[1] and "four" in lines[1], lines


@pytest.mark.parametrize(
    ("command", "spaced", "bracketed", "expected"),
    [
        (train.COMMAND, ["--data.input", "a.txt", "b.txt"], ["--data.input", "[a.txt,b.txt]"],
         {"data.input": ["a.txt", "b.txt"]}),
        (evaluate.COMMAND, ["--ckpt", "a", "b", "--labels", "x", "y", "--eval.lengths", "32", "16",
                            "--eval.rope_scaling", "none", "yarn"],
         ["--ckpt", "[a,b]", "--labels", "[x,y]", "--eval.lengths", "[32,16]", "--eval.rope_scaling", "[none,yarn]"],
         {"ckpt": ["a", "b"], "labels": ["x", "y"], "eval.lengths": [16, 32], "eval.rope_scaling": ["none", "yarn"]}),
        (attention_maps.COMMAND, ["--ckpt", "a", "b", "--labels", "x", "y", "--lengths", "64", "--layers", "0", "1",
                                  "--heads", "2"],
         ["--ckpt", "[a,b]", "--labels", "[x,y]", "--lengths", "[64]", "--layers", "[0,1]", "--heads", "[2]"],
         {"ckpt": ["a", "b"], "labels": ["x", "y"], "lengths": [64], "layers": [0, 1], "heads": [2]}),
        (extrapolation.COMMAND, ["--seeds", "1", "2", "--schemes", "rope", "alibi"],
         ["--seeds", "[1,2]", "--schemes", "[rope,alibi]"], {"seeds": [1, 2], "schemes": ["rope", "alibi"]}),
        (synthetic.COMMAND, [*SYNTHETIC, "--seeds", "3", "--task.eval_lengths", "5", "10"],
         [*SYNTHETIC, "--seeds", "[3]", "--task.eval_lengths", "[5,10]"], {"seeds": [3], "task.eval_lengths": [5, 10]}),
        (prepare.COMMAND, ["--inputs", "a", "b", "--out_dir", "o"], ["--inputs", "[a,b]", "--out_dir", "o"],
         {"inputs": ["a", "b"]}),
        (BENCH["vs-nanogpt"], ["--peer", "p", "--input", "t", "--steps", "25", "45", "--ours_args=--x=1"],
         ["--peer", "p", "--input", "t", "--steps", "[25,45]", "--ours_args", "[--x=1]"],
         {"steps": (25, 45), "ours_args": ["--x=1"]}),
    ],
)  # fmt: skip
def test_list_options_take_both_syntaxes(command, spaced, bracketed, expected):
    configs = [cli.parse(command, argv) for argv in (spaced, bracketed)]
    assert configs[0] == configs[1]
    for name, value in expected.items():
        got = configs[0]
        for part in name.split("."):
            got = getattr(got, part)
        assert got == value, name


def test_sample_alone_has_no_list_option():
    assert cli.sequence_options(sample.COMMAND) == {}
    assert all(cli.sequence_options(command) for name, command in COMMANDS.items() if name != "sample.py")


def test_the_options_come_from_the_dataclass_and_are_the_parsers(capsys):
    """The names that suggestions and messages use (walked from the dataclass) are exactly what --help lists."""
    for command in (*COMMANDS.values(), *BENCH.values()):
        with pytest.raises(SystemExit) as info:
            cli.run(command, ["--help"])
        listed = set(re.findall(r"^\s+(?:-h, )?--([\w.]+)", capsys.readouterr().out, re.MULTILINE))
        listed = {name for name in listed if not name.endswith(".help")}  # jsonargparse's help of a class (Variant)
        assert info.value.code == 0 and listed == set(cli.options(command)), command.prog


def test_hidden_options_load_older_files_and_a_runs_config_yaml(tmp_path):
    old = cli.parse(extrapolation.COMMAND, ["--config", str(ROOT / "docs/extrapolation_shakespeare/experiment.yaml")])
    assert "rope-window64" in [v.name for v in old.models()]  # it records run.model.vocab_size
    assert "run.model.vocab_size" not in cli.options(extrapolation.COMMAND)
    assert "model.vocab_size" not in cli.options(train.COMMAND)  # a run's config.yaml records it: read back, unused
    used = cli.parse(train.COMMAND, ["--model.n_layer", "3"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(used)))
    assert cli.parse(train.COMMAND, ["--config", str(tmp_path / "config.yaml")]) == used


def test_messages_spell_options_as_the_command_takes_them():
    assert cli.spell("pass --data.input FILE.", extrapolation.COMMAND) == "pass --run.data.input FILE."
    assert cli.spell("--device tpu: use --device cpu", evaluate.COMMAND) == "--eval.device tpu: use --eval.device cpu"
    assert cli.spell("--eval_data.input x", attention_maps.COMMAND) == "--data.input x"
    assert cli.spell("(--data.prepared_root DIR)", prepare.COMMAND) == "(--out_dir DIR)"
    assert cli.spell("--train.resume auto", train.COMMAND) == "--train.resume auto"
    assert cli.spell("--no.such-option", train.COMMAND) == "--no.such-option"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A tiny char-level RoPE checkpoint (tests/assets), trained on generated English."""
    bundle = torch.load(ROOT / "tests" / "assets" / "pre-redesign.pt", weights_only=False)
    path = tmp_path / "rope.ckpt"
    torch.save(bundle["rope"]["checkpoint"], path)
    return path


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("POSGPT_CACHE", str(tmp_path / "empty-cache"))

    def no_network(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)


def _named_options(line: str) -> list[str]:
    return [m.group(1) for m in cli.OPTION.finditer(line)]


def test_options_named_in_error_messages_parse_in_the_command_that_prints_them(tmp_path, capsys, checkpoint, offline):
    bad_utf8, short, odd = tmp_path / "latin1.txt", tmp_path / "short.txt", tmp_path / "odd.txt"
    bad_utf8.write_bytes(b"caf\xe9\n" * 50)
    short.write_text("The king.\n")
    odd.write_text("The kïng.\n" * 50)
    (tmp_path / "no-txt").mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ckpt, out = str(checkpoint), str(tmp_path / "out")
    run = ["--data.prepared_root", f"{tmp_path}/p", "--train.out_dir", f"{tmp_path}/runs"]
    cases = [
        ("experiments.extrapolation", ["--out_dir", out, "--run.data.input", "shakespeare"], "--run.data.input"),
        ("train.py", ["--data.input", str(bad_utf8), *run], "--data.errors"),
        ("train.py", ["--data.input", str(bad_utf8), *run[:2], "--train.out_dir", str(a_file)], "--train.out_dir"),
        ("data.prepare", ["--inputs", str(bad_utf8), "--out_dir", out], "--errors"),
        ("data.prepare", ["--inputs", str(tmp_path / "no-txt"), "--out_dir", out], "--glob"),
        ("data.prepare", ["--inputs", str(short), "--out_dir", str(a_file / "x")], "--out_dir"),
        ("sample.py", ["--ckpt", ckpt, "--prompt", "kïng"], "--drop_unknown"),
        ("sample.py", ["--ckpt", ckpt, "--device", "tpu"], "--device"),
        ("evaluate.py", ["--ckpt", ckpt, "--eval_data.input", str(short), "--out", out], "--eval.lengths"),
        ("evaluate.py", ["--ckpt", ckpt, "--eval_data.input", str(odd), "--out", out], "--eval_data.drop_unknown"),
        ("evaluate.py", ["--ckpt", ckpt, "--eval.stride", "8", "--out", out], "--eval.mode"),
        ("attention_maps.py", ["--ckpt", ckpt, "--text", str(short), "--lengths", "64", "--out", out], "--lengths"),
        ("attention_maps.py", ["--ckpt", ckpt, "--text", str(odd), "--lengths", "8", "--out", out],
         "--data.drop_unknown"),
        ("attention_maps.py", ["--ckpt", ckpt, "--prompt", "The", "--layers", "3", "--out", out], "--layers"),
    ]  # fmt: skip
    for name, argv, expected in cases:
        (line,) = _stops(capsys, name, [*argv, *(["--progress", "false"] if name == "attention_maps.py" else [])])
        named = _named_options(line)
        command = COMMANDS[name]
        assert expected[2:] in named and set(named) <= {*cli.options(command), *command.hidden}, (name, line)


@dataclasses.dataclass
class Nothing:
    """No options."""


def _ending(capsys, error: BaseException) -> tuple[int, str]:
    def fail(cfg: Nothing) -> None:
        raise error

    with pytest.raises(SystemExit) as info:
        cli.run(cli.Command("x", Nothing, fail), [])
    return info.value.code, capsys.readouterr().err


def test_how_each_ending_is_reported(capsys):
    assert _ending(capsys, UserError("fix it")) == (2, "error: fix it\n")
    stopped = "Stopped by SIGTERM at step 3; saved last.ckpt."
    assert _ending(capsys, TrainingStopped(stopped, 143)) == (143, f"{stopped}\n")
    assert _ending(capsys, TrainingDiverged("Training diverged.")) == (2, "error: Training diverged.\n")
    assert _ending(capsys, KeyboardInterrupt()) == (130, "Interrupted.\n")
    with pytest.raises(RuntimeError):  # a bug keeps its traceback
        _ending(capsys, RuntimeError("bug"))


def test_an_unknown_variant_field_a_refused_value_and_a_per_run_field_name_the_variant(capsys):
    argv = ["--variants", "{name: w, model: {attn_window: -1}}"]
    assert cli_error(capsys, extrapolation.COMMAND, argv).startswith("error: w: ")
    argv = ["--variants", "{name: r, train: {random_positions: 8}}", "--run.model.block_size", "16"]
    message = cli_error(capsys, extrapolation.COMMAND, argv)
    assert message.startswith("error: r: ") and "random_positions" in message


def test_every_bool_option_of_every_command_takes_a_bare_flag_as_true():
    """`--quick` alone is `--quick true` (jsonargparse gives a bool one value, always: `core.cli.spread_lists`), and
    `--quick false`, `--quick=false` and a bare flag before another option keep working; read from the parsers."""
    commands = [*COMMANDS.values(), *BENCH.values(), *(loaded(posgpt_cli.MODES)[m] for m in ("plot", "check"))]
    checked = 0
    for command in commands:
        flags, parser = cli.bool_options(command), cli.build_parser(command)
        for flag in sorted(flags):
            cases = (([f"--{flag}"], True), ([f"--{flag}", "false"], False), ([f"--{flag}=false"], False),
                     ([f"--{flag}", "--help_never_given"], None))  # fmt: skip
            for argv, expected in cases:
                if expected is None:  # a bare flag followed by another option: true, and the other one refused
                    with pytest.raises(argparse.ArgumentError, match="help_never_given"):
                        _parsed(command, parser, argv, flags)
                    continue
                assert _parsed(command, parser, argv, flags)[flag] is expected, (command.prog, argv)
                checked += 1
    assert checked > 3 * 40  # every command's: train's, sample's --stream (bool | None), check's --quick, ...
    check = loaded(posgpt_cli.MODES)["check"]
    assert cli.parse(check, ["--quick", "--only", "rope"]).quick is True  # as the commands parse


def _parsed(command, parser, argv: list[str], flags: set[str]):
    """The namespace of `argv`, with a placeholder for each required option it lacks (this checks flags only)."""
    sequences = cli.sequence_options(command)
    try:
        return parser.parse_args(cli.spread_lists(argv, sequences, flags))
    except argparse.ArgumentError as error:
        missing = re.match(r"the following arguments are required: (.*)", str(error))
        if not missing:
            raise
        placeholders = [a for name in missing.group(1).split(", ") for a in (f"--{name}", "x")]
        return parser.parse_args(cli.spread_lists([*argv, *placeholders], sequences, flags))


HELP = "Run 'train.py --help' for the options."


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--train.max_steps", "abc"], "error: --train.max_steps takes an integer, got 'abc'"),
        (["--model.n_kv_head", "two"], "error: --model.n_kv_head takes an integer or null, got 'two'"),
        (["--model.dropout", "lots"], "error: --model.dropout takes a number, got 'lots'"),
    ],
)
def test_a_value_of_the_wrong_type_gets_one_line_naming_the_option_and_the_type(argv, line, capsys):
    with pytest.raises(SystemExit) as info:
        cli.run(train.COMMAND, argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and lines == [
        "usage: train.py [options]",
        line,
        "Run 'train.py --help' for the options.",
    ]


def test_a_dotted_override_of_one_field_of_a_kind_changes_that_field_alone():
    """Issue 57: `--model.kinds.global.attn_temperature_floor 32` replaced iRoPE's global kind by that one field,
    so its NoPE layers trained as RoPE layers; values read as any option's (1e6 a number)."""
    argv = ["--config", "configs/irope.yaml", "--model.kinds.global.attn_temperature_floor", "32",
            "--model.kinds.local.rope_base=1e6", "--model.kinds.local.attn_chunk", "8"]  # fmt: skip
    kinds = cli.parse(train.COMMAND, argv).model.kinds
    assert kinds == {
        "local": {"attn_chunk": 8, "rope_base": 1e6},
        "global": {"pos_encoding": "none", "attn_temperature_floor": 32},
    }
    assert cli.parse(train.COMMAND, argv[:2]).model.kinds["global"] == {
        "pos_encoding": "none",
        "attn_temperature_floor": 16,
    }


def test_a_dotted_override_of_a_kind_without_its_value_is_a_usage_error(capsys):
    """A field of a kind given no value (at the end, or before the next option) is the parser's one line, not a
    traceback nor the next option taken as its value; `layout: []` with `kinds: {}` (one kind's own config inside
    the model) is refused as a model's."""
    for argv in (["--model.kinds.global.rope_base"], ["--model.kinds.global.attn_window", "--train.max_steps", "5"]):
        with pytest.raises(SystemExit) as info:
            cli.run(train.COMMAND, ["--config", "configs/irope.yaml", *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "error: argument --model.kinds: expected one argument" in err, err
    assert "model.layout [] names no kind" in cli_error(
        capsys, train.COMMAND, ["--model.layout", "[]", "--model.kinds", "{}"]
    )
