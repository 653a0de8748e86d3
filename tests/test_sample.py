"""sample.py end to end on a checkpoint from a tiny training run, and its error messages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sample as sample_script
import train as train_script
from posgpt.core import cli
from posgpt.data.tokenizer import CharTokenizer, GPT2Tokenizer
from posgpt.evaluation import sampling
from posgpt.evaluation.checkpoint import load_checkpoint
from posgpt.evaluation.sampling import Rows, stop_text
from posgpt.model import GPT, GPTConfig

from helpers import cli_error

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp: Path, *extra: str) -> Path:
    """last.ckpt of a 30-step run of a 2-layer char model (block 32) on generated text."""
    from conftest import make_text

    text = tmp / "corpus.txt"
    text.write_text(make_text())
    cli.run(train_script.COMMAND, [
        "--model.n_layer", "2", "--model.n_head", "4", "--model.n_embd", "32", "--model.block_size", "32",
        "--train.batch_size", "8", "--train.max_steps", "30", "--train.eval_interval", "30",
        "--train.progress_bar", "false", "--train.sample_tokens", "0", "--train.logger", "none",
        "--optim.lr", "3e-3", "--optim.warmup_steps", "5",
        "--data.input", str(text), "--data.prepared_root", str(tmp / "prepared"),
        "--train.out_dir", str(tmp / "runs"), "--train.run_name", "tiny", *extra,
    ])  # fmt: skip
    return tmp / "runs" / "tiny" / "last.ckpt"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """RoPE, the default scheme."""
    return _train(tmp_path_factory.mktemp("sample"))


@pytest.fixture(scope="module")
def learned_checkpoint(tmp_path_factory) -> Path:
    """Learned positions: a model with a longest position (32)."""
    return _train(tmp_path_factory.mktemp("sample_learned"), "--model.pos_encoding", "learned")


def _sample(capsys, *args: str) -> str:
    return _run(capsys, *args)[0]


def _run(capsys, *args: str) -> tuple[str, str]:
    """stdout and stderr of sample.py run in-process."""
    cli.run(sample_script.COMMAND, list(args))
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_same_seed_same_sample_and_the_prompt_is_continued(checkpoint, capsys):
    args = ["--ckpt", str(checkpoint), "--prompt", "The king", "--max_new_tokens", "40", "--seed", "5"]
    first, second = _sample(capsys, *args), _sample(capsys, *args)
    assert first == second and first.startswith("The king") and len(first.rstrip("\n")) == len("The king") + 40
    assert _sample(capsys, *args[:-1], "6") != first


def test_cache_and_no_cache_give_the_same_text(checkpoint, capsys):
    args = ["--ckpt", str(checkpoint), "--prompt", "A fool", "--max_new_tokens", "40", "--temperature", "0"]
    assert _sample(capsys, *args) == _sample(capsys, *args, "--no_cache", "true")


def test_several_samples_and_prompt_from_a_file(checkpoint, capsys, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("My lord")
    out, err = _run(capsys, "--ckpt", str(checkpoint), "--prompt", f"@{prompt}", "--num_samples", "3",
                    "--max_new_tokens", "20")  # fmt: skip
    samples = _rows(out)
    assert len(samples) == 3 and all(s.startswith("My lord") for s in samples)
    assert _speed(err)[1] == "60" and "compile" not in err


def test_empty_prompt_starts_from_a_newline(checkpoint, capsys):
    out = _sample(capsys, "--ckpt", str(checkpoint), "--max_new_tokens", "20")
    assert out.startswith("\n") and len(out) >= 20


def test_command_line_streams_text_and_reports_speed(checkpoint):
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(checkpoint), "--prompt", "The queen",
         "--max_new_tokens", "30", "--stream", "true"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The queen") and "tokens/s" not in result.stdout
    assert "tokens/s" in result.stderr


def test_characters_outside_the_vocabulary_are_named_or_dropped(checkpoint, capsys):
    message = cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(checkpoint), "--prompt", "The kïng€",
                                                        "--max_new_tokens", "5"])  # fmt: skip
    assert "'ï€'" in message and "--drop_unknown" in message
    out = _sample(
        capsys, "--ckpt", str(checkpoint), "--prompt", "The kïng", "--drop_unknown", "true", "--max_new_tokens", "5"
    )
    assert out.startswith("The kng")


def test_missing_or_corrupt_checkpoint_fails_with_one_message(tmp_path, capsys):
    assert "Checkpoint not found" in cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(tmp_path / "nope.ckpt")])
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    assert "not a readable checkpoint" in cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(corrupt)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_one_clear_message(checkpoint, capsys):
    argv = ["--ckpt", str(checkpoint), "--device", "cuda", "--max_new_tokens", "2"]
    assert "CUDA is not available here" in cli_error(capsys, sample_script.COMMAND, argv)


def test_bfloat16_weights_on_cpu_sample_as_a_gpu_run_would(checkpoint, capsys):
    """`--dtype auto` is bfloat16 on a GPU: the same cast weights, run here on the CPU."""
    args = ["--ckpt", str(checkpoint), "--prompt", "The king", "--max_new_tokens", "30", "--device", "cpu"]
    cli.run(sample_script.COMMAND, [*args, "--dtype", "bfloat16", "--temperature", "0"])
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("The king") and len(out.rstrip("\n")) == len("The king") + 30
    assert "cpu, torch.bfloat16" in captured.err
    uncached = _sample(capsys, *args, "--dtype", "bfloat16", "--temperature", "0", "--no_cache", "true")
    assert uncached == out  # the KV cache holds bf16 keys and values, as the uncached path computes them


SPEED = re.compile(
    r"(\d+) tokens in [\d.]+ s: [\d.]+ tokens/s, first token \d+ ms "
    r"\((kv cache: [^;]* KV heads?|no cache|constant state), \w+, torch\.\w+.*\)"
)


def test_the_cache_line_counts_kv_heads_in_words():
    for kv_heads, words in ((1, "1 KV head"), (2, "2 KV heads")):  # issue 57: "1 KV heads"
        config = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, n_kv_head=kv_heads)
        assert sampling.cache_in_words(GPT(config)) == f"kv cache: every key, {words}"


def _speed(err: str) -> re.Match:
    """The speed line, which must be the last on stderr; group 1 is the tokens counted."""
    match = SPEED.fullmatch(err.strip().splitlines()[-1])
    assert match, err
    return match


def _rows(out: str) -> list[str]:
    return out.removesuffix("\n").split(sampling.SEPARATOR)


def _greedy_batch_and_alone(capsys, checkpoint: Path, tmp_path: Path, prompts: list[str]) -> None:
    """Greedy rows of a --prompts_file batch, each prompt twice, in the file's order, equal each prompt
    sampled alone; every row is counted."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    common = ["--ckpt", str(checkpoint), "--max_new_tokens", "24", "--temperature", "0"]
    out, err = _run(capsys, *common, "--prompts_file", str(path), "--num_samples", "2")
    alone = [_sample(capsys, *common, "--prompt", p).removesuffix("\n") for p in prompts]
    assert _rows(out) == [a for a in alone for _ in range(2)]
    assert all(a.startswith(p) for a, p in zip(alone, prompts, strict=True))
    assert _speed(err)[1] == str(2 * len(prompts) * 24)


def test_a_prompts_file_is_one_batch_in_the_files_order(checkpoint, capsys, tmp_path):
    _greedy_batch_and_alone(capsys, checkpoint, tmp_path, ["The king", "Good sir", "My lord."])  # one length


def test_greedy_rows_of_prompts_of_other_lengths_equal_each_prompt_alone(checkpoint, capsys, tmp_path):
    _greedy_batch_and_alone(capsys, checkpoint, tmp_path, ["A fool", "The queen speaks of", "My lord"])


def test_sampled_rows_of_prompts_of_other_lengths_come_in_the_files_order(checkpoint, capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("A fool\nThe queen speaks of\n")
    out = _sample(capsys, "--ckpt", str(checkpoint), "--prompts_file", str(path), "--num_samples", "2",
                  "--max_new_tokens", "10")  # fmt: skip
    assert [row[:6] for row in _rows(out)] == ["A fool", "A fool", "The qu", "The qu"]


def test_each_row_stops_at_its_stop_string_and_the_batch_when_all_have(checkpoint, capsys, monkeypatch):
    common = ["--ckpt", str(checkpoint), "--prompt", "The king", "--num_samples", "4", "--max_new_tokens", "80",
              "--seed", "3"]  # fmt: skip
    full = [row[len("The king") :] for row in _rows(_sample(capsys, *common))]
    expected = [text.split(".")[0] for text in full]
    assert len({len(text) for text in expected}) > 1 and all(
        len(t) < len(f) for t, f in zip(expected, full, strict=True)
    )
    steps = []
    stream = sampling.stream
    monkeypatch.setattr(sampling, "stream", lambda *a, **k: (steps.append(t) or t for t in stream(*a, **k)))
    out, err = _run(capsys, *common, "--stop", ".")
    assert [row[len("The king") :] for row in _rows(out)] == expected  # the same draws, each row cut at its stop
    assert len(steps) == max(len(text) for text in expected) + 1  # ends at the last row's stop
    assert int(_speed(err)[1]) == sum(len(text) + 1 for text in expected)  # each row's tokens until it stopped


def test_a_stop_string_is_found_across_tokens_and_never_shown():
    chars = CharTokenizer("ab\n")
    rows = Rows(1, chars, stop=stop_text(r"\n\n"), end=chars.end_id)
    for c in "ab\n":
        rows.add(chars.encode(c))
    assert rows.shown(0) == "ab" and rows.texts[0] == "ab\n" and not all(rows.done)
    rows.add(chars.encode("\n"))
    rows.add(chars.encode("a"))  # a stopped row takes no more
    assert all(rows.done) and rows.texts[0] == "ab" and rows.tokens == 4
    assert stop_text(r"a\tb\\n") == "a\tb\\n" and chars.end_id is None


def test_the_end_of_text_token_ends_a_row_and_is_left_out(gpt2_ranks):
    bpe = GPT2Tokenizer(gpt2_ranks)
    assert bpe.end_id == 50256  # <|endoftext|>
    first = bpe.encode(" Hello") + [50256] + bpe.encode(" more text")
    second = bpe.encode(" a smile 🙂 here")  # the emoji spans tokens
    second = (second + bpe.encode(" and on and on and on"))[: len(first)]
    rows = Rows(2, bpe, stop=None, end=bpe.end_id)
    for step in zip(first, second, strict=True):
        rows.add(list(step))
    rows.finish()
    assert rows.texts[0] == " Hello" and rows.texts[1] == bpe.decode(second) and "🙂" in rows.texts[1]
    assert rows.done == [True, False] and rows.tokens == len(bpe.encode(" Hello")) + 1 + len(second)


def test_a_row_ends_at_an_end_token_as_at_the_same_stop_string(checkpoint, capsys, monkeypatch):
    """A char tokenizer has no end-of-text token: given one (the space), rows end as at --stop " "."""
    common = ["--ckpt", str(checkpoint), "--prompt", "The king", "--num_samples", "3", "--max_new_tokens", "60"]
    out, err = _run(capsys, *common, "--stop", " ")
    space = load_checkpoint(checkpoint).tokenizer.encode(" ")
    monkeypatch.setattr(CharTokenizer, "end_id", space[0])
    out_end, err_end = _run(capsys, *common)
    assert out_end == out and _speed(err_end)[1] == _speed(err)[1] != "180"


def test_streaming_stops_printing_at_the_stop(checkpoint, capsys):
    common = ["--ckpt", str(checkpoint), "--prompt", "The king", "--max_new_tokens", "300", "--stop", "e ",
              "--seed", "3"]  # fmt: skip
    streamed = _sample(capsys, *common, "--stream", "true")
    assert streamed == _sample(capsys, *common, "--stream", "false")
    assert len(streamed) < len("The king") + 300 and "e " not in streamed[len("The king") :]


def test_bad_prompts_are_one_message_naming_them(checkpoint, capsys, tmp_path):
    files = {"empty.txt": "", "blank.txt": "The king\n\nA fool\n", "odd.txt": "The king\nïï€\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    cases = [
        (["--prompts_file", str(tmp_path / "missing.txt")], "--prompts_file", "no such file"),
        (["--prompts_file", str(tmp_path / "empty.txt")], "empty.txt is empty", "one prompt per line"),
        (["--prompts_file", str(tmp_path / "blank.txt")], "blank.txt: line 2 is empty", "one prompt per line"),
        (["--prompts_file", str(tmp_path / "odd.txt")], "line 2 of --prompts_file", "'ï€'"),
        (["--prompts_file", str(tmp_path / "odd.txt"), "--drop_unknown", "true"], "line 2 of --prompts_file",
         "--drop_unknown leaves nothing"),
        (["--prompt", "ïï", "--drop_unknown", "true"], "--prompt ('ïï')", "leaves nothing"),
        (["--prompts_file", str(tmp_path / "blank.txt"), "--prompt", "The"], "--prompts_file", "not both"),
        (["--prompts_file", str(tmp_path / "blank.txt"), "--prompt_file", "x"], "--prompt_file", "not both"),
        (["--stop", ""], "--stop must not be empty", ""),
        (["--stream", "true", "--num_samples", "2"], "--stream true", "--num_samples"),
    ]  # fmt: skip
    for argv, *expected in cases:
        message = cli_error(capsys, sample_script.COMMAND, ["--ckpt", str(checkpoint), *argv])
        assert all(part in message for part in expected), (argv, message)


def test_a_prompt_past_the_learned_positions_is_cropped_with_one_line(checkpoint, learned_checkpoint, capsys):
    long = "The king speaks of the crown. A fool loves the sea."
    common = ["--max_new_tokens", "20", "--temperature", "0"]
    out, err = _run(capsys, "--ckpt", str(learned_checkpoint), "--prompt", long, *common)
    note, _ = err.strip().splitlines()
    assert "--prompt" in note and "last 32 tokens" in note and out.startswith(long)
    short, err = _run(capsys, "--ckpt", str(learned_checkpoint), "--prompt", long[-32:], *common)
    assert out[len(long) :] == short[32:] and len(err.strip().splitlines()) == 1
    rope, err = _run(capsys, "--ckpt", str(checkpoint), "--prompt", long, *common)  # issue 57: RoPE saw 4 x 32
    note, _ = err.strip().splitlines()  # the training length, as learned positions: said, naming --max_context
    assert "more than --max_context 32 (default block_size)" in note and "last 32 tokens" in note
    assert rope[len(long) :] == _sample(capsys, "--ckpt", str(checkpoint), "--prompt", long[-32:], *common)[32:]
    out, err = _run(capsys, "--ckpt", str(checkpoint), "--prompt", long, *common, "--max_context", "20")
    note, _ = err.strip().splitlines()  # the schemes that extrapolate see --max_context tokens: said too
    assert "more than --max_context 20" in note and "last 20 tokens" in note and out.startswith(long)


def test_compile_compiles_for_decoding_and_times_a_warm_up_apart(checkpoint, capsys, monkeypatch):
    compiled: list[torch.nn.Module] = []
    monkeypatch.setattr(sampling, "compile_for_decoding", compiled.append)  # no Inductor in the tests
    monkeypatch.setattr(torch.nn.Module, "compile", lambda *a, **k: pytest.fail("model.compile"))
    calls = []
    stream = sampling.stream
    monkeypatch.setattr(
        sampling, "stream", lambda m, idx, n, *a, **k: calls.append((idx.shape, n)) or stream(m, idx, n, *a, **k)
    )
    common = ["--ckpt", str(checkpoint), "--prompt", "The king", "--max_new_tokens", "30", "--num_samples", "2"]
    out, err = _run(capsys, *common, "--compile", "true")
    assert len(compiled) == 1 and calls == [((2, 8), 30), ((2, 8), 30)]  # the warm-up: the same cache size
    assert re.search(r"; compile \d+\.\d s\)$", _speed(err)[0])
    assert out == _sample(capsys, *common)  # the warm-up draws from its own generator
