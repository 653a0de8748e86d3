"""GPT-2 weights (--model.init_from): a tiny GPT-2-layout safetensors file written here, loaded and held
to a reference GPT-2 forward written here; the Hugging Face cache; refusals; tanh GELU; a scheme that
replaces GPT-2's table; the study option. No real GPT-2 weights exist here: the comparison with
Hugging Face's own model is skip-guarded."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from posgpt.core import cli
from posgpt.core.errors import ConfigError
from posgpt.experiments import extrapolation
from posgpt.model import GPTConfig
from posgpt.model.gpt import MLP
from posgpt.model.pretrained import PretrainedError, from_pretrained, hub_cache, weights_file
from posgpt.training.command import COMMAND as TRAIN
from posgpt.training.config import DataConfig, RunConfig

from helpers import cli_error

LAYERS, HEADS, WIDTH, POSITIONS, VOCAB = 2, 2, 32, 64, 50257


def gpt2_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """GPT-2's names and layouts (Conv1D weights as (in, out)), small random values; like GPT-2's, the
    logits are strongly negative: every token row leans against ln_f's bias in one coordinate, which
    ln_f's weight leaves out, so each logit has -9 added."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    lean = F.one_hot(torch.tensor(0), WIDTH).float()
    w = {"wte.weight": r(VOCAB, WIDTH) - 3 * lean, "wpe.weight": r(POSITIONS, WIDTH),
         "ln_f.weight": (1 + r(WIDTH)) * (1 - lean), "ln_f.bias": r(WIDTH) + 3 * lean}  # fmt: skip
    for i in range(LAYERS):
        w |= {f"h.{i}.ln_1.weight": 1 + r(WIDTH), f"h.{i}.ln_1.bias": r(WIDTH),
              f"h.{i}.attn.c_attn.weight": r(WIDTH, 3 * WIDTH), f"h.{i}.attn.c_attn.bias": r(3 * WIDTH),
              f"h.{i}.attn.c_proj.weight": r(WIDTH, WIDTH), f"h.{i}.attn.c_proj.bias": r(WIDTH),
              f"h.{i}.ln_2.weight": 1 + r(WIDTH), f"h.{i}.ln_2.bias": r(WIDTH),
              f"h.{i}.mlp.c_fc.weight": r(WIDTH, 4 * WIDTH), f"h.{i}.mlp.c_fc.bias": r(4 * WIDTH),
              f"h.{i}.mlp.c_proj.weight": r(4 * WIDTH, WIDTH), f"h.{i}.mlp.c_proj.bias": r(WIDTH),
              f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, POSITIONS, POSITIONS))}  # fmt: skip
    return w


def reference_gpt2(w: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward as OpenAI wrote it: learned positions, pre-LN blocks, tanh GELU, tied head."""
    _, T = idx.shape
    x = w["wte.weight"][idx] + w["wpe.weight"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(LAYERS):
        h = F.layer_norm(x, (WIDTH,), w[f"h.{i}.ln_1.weight"], w[f"h.{i}.ln_1.bias"], 1e-5)
        q, k, v = (h @ w[f"h.{i}.attn.c_attn.weight"] + w[f"h.{i}.attn.c_attn.bias"]).split(WIDTH, dim=-1)
        q, k, v = (t.unflatten(-1, (HEADS, WIDTH // HEADS)).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS)).masked_fill(~mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        x = x + y @ w[f"h.{i}.attn.c_proj.weight"] + w[f"h.{i}.attn.c_proj.bias"]
        h = F.layer_norm(x, (WIDTH,), w[f"h.{i}.ln_2.weight"], w[f"h.{i}.ln_2.bias"], 1e-5)
        m = F.gelu(h @ w[f"h.{i}.mlp.c_fc.weight"] + w[f"h.{i}.mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ w[f"h.{i}.mlp.c_proj.weight"] + w[f"h.{i}.mlp.c_proj.bias"]
    x = F.layer_norm(x, (WIDTH,), w["ln_f.weight"], w["ln_f.bias"], 1e-5)
    return x @ w["wte.weight"].T


def tiny_config(source: Path | str, **fields) -> GPTConfig:
    shape = {"n_layer": LAYERS, "n_head": HEADS, "n_embd": WIDTH, "block_size": POSITIONS, "vocab_size": VOCAB,
             "bias": True, "gelu_approximate": "tanh", "pos_encoding": "learned", "init_from": str(source)}  # fmt: skip
    return GPTConfig(**(shape | fields))


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("gpt2-tiny")
    tensors = gpt2_tensors()
    named = {f"transformer.{k}" if k.startswith("h.0") else k: v for k, v in tensors.items()}  # HF saves either
    save_file(named, str(directory / "model.safetensors"))
    return directory, tensors


def test_a_gpt2_layout_file_gives_gpt2s_logits(weights):
    directory, tensors = weights
    model = from_pretrained(tiny_config(directory)).eval()
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(idx)
    expected = reference_gpt2(tensors, idx)
    assert torch.allclose(logits[..., :VOCAB], expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(model.lm_head.weight, model.wte.weight)  # still tied


def test_the_loss_is_gpt2s_the_padded_rows_take_no_probability(weights):
    """The vocabulary is padded 50257 -> 50304 and the loss is a softmax over every row: a zero row's
    logit 0 would outweigh GPT-2's negative logits (here by over a nat)."""
    directory, tensors = weights
    model = from_pretrained(tiny_config(directory)).eval()
    idx = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, loss = model(idx[:, :-1], idx[:, 1:])
    expected = F.cross_entropy(reference_gpt2(tensors, idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    assert model.config.padded_vocab_size > VOCAB and abs(loss.item() - expected.item()) < 1e-3


def test_the_download_command_named_is_one_that_huggingface_hub_installs():
    """The base install has no huggingface_hub; once installed it gives `hf` (its older command, whose name no
    message or page may use, is gone from its current versions)."""
    from importlib.metadata import entry_points

    pytest.importorskip("huggingface_hub")
    assert "hf" in {script.name for script in entry_points(group="console_scripts")}
    root = Path(__file__).resolve().parents[1]
    pages = [*root.glob("*.md"), *root.glob("docs/*.md"), *root.glob("configs/*.yaml"), *root.glob("*/*.py")]
    assert not [str(p) for p in pages if "huggingface" + "-cli" in p.read_text(encoding="utf-8")]


def test_the_hugging_face_cache_is_searched_and_missing_weights_say_where(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache() == tmp_path / "hub"
    with pytest.raises(PretrainedError) as missing:
        weights_file("gpt2")
    assert "https://huggingface.co/openai-community/gpt2" in str(missing.value)
    assert "`pip install huggingface_hub` and `hf download gpt2 model.safetensors config.json`" in str(missing.value)
    snapshot = tmp_path / "hub" / "models--gpt2" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"")
    (tmp_path / "hub" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--gpt2" / "refs" / "main").write_text("abc123\n")
    assert weights_file("gpt2") == snapshot / "model.safetensors"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    with pytest.raises(PretrainedError, match="not a directory, a checkpoint .* or one of gpt2, gpt2-medium"):
        weights_file("gpt3")


def test_a_model_of_another_shape_or_vocabulary_is_refused_in_one_line(weights):
    directory, _ = weights
    with pytest.raises(PretrainedError, match=r"differs in n_layer, gelu_approximate: pass --model.n_layer 2 "):
        from_pretrained(tiny_config(directory, n_layer=3, gelu_approximate="none"))
    with pytest.raises(PretrainedError, match="pass --data.tokenizer gpt2"):
        from_pretrained(tiny_config(directory, vocab_size=65))
    with pytest.raises(PretrainedError, match="has 64 learned positions: pass --model.block_size 64 or less"):
        from_pretrained(tiny_config(directory, block_size=128))
    with pytest.raises(ValueError, match="pass --data.tokenizer gpt2"):
        RunConfig(model=tiny_config(directory), data=DataConfig(tokenizer="char"))
    medium = GPTConfig(init_from="gpt2-medium", n_layer=24, n_head=16, n_embd=1024)
    with pytest.raises(ConfigError, match="differs in gelu_approximate: pass --model.n_layer 24 --model.n_head 16 "):
        RunConfig(model=medium, data=DataConfig(tokenizer="gpt2"))  # when the run is built: before any data
    RunConfig(model=GPTConfig(init_from="gpt2", gelu_approximate="tanh"), data=DataConfig(tokenizer="gpt2"))


def test_weights_that_cannot_be_read_are_refused_in_one_line(weights, tmp_path, monkeypatch):
    directory, tensors = weights
    save_file({"model.embed_tokens.weight": tensors["wte.weight"][:8]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(PretrainedError, match=r"not GPT-2's layout \(GPT2LMHeadModel's tensor names\), missing wte"):
        from_pretrained(tiny_config(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(PretrainedError, match="Cannot read"):
        from_pretrained(tiny_config(tmp_path))
    monkeypatch.setitem(sys.modules, "safetensors", None)  # the package not installed
    with pytest.raises(PretrainedError, match="needs the safetensors package: pip install safetensors"):
        from_pretrained(tiny_config(directory))


def test_gelu_approximate_tanh_is_gpt2s_gelu():
    x = torch.linspace(-4, 4, 128)
    exact, tanh = (MLP(GPTConfig(n_embd=32, n_head=2, gelu_approximate=a)).gelu for a in ("none", "tanh"))
    assert torch.equal(tanh(x), F.gelu(x, approximate="tanh")) and not torch.equal(exact(x), tanh(x))
    with pytest.raises(ValueError, match="gelu_approximate must be one of"):
        GPTConfig(gelu_approximate="fast")


def test_another_scheme_replaces_gpt2s_table_and_keeps_the_blocks(weights):
    directory, tensors = weights
    learned = from_pretrained(tiny_config(directory))
    alibi = from_pretrained(tiny_config(directory, pos_encoding="alibi", block_size=256))
    assert alibi.config.pos_encoding == "alibi" and not any("pe.table" in k for k in alibi.state_dict())
    kept = {k: v for k, v in learned.state_dict().items() if not k.startswith("pe.")}
    assert all(torch.equal(v, alibi.state_dict()[k]) for k, v in kept.items())
    idx = torch.randint(0, VOCAB, (1, 200))
    assert alibi(idx)[0].shape[1] == 200  # beyond GPT-2's 64 positions


def test_fine_tuning_gpt2_into_other_schemes_is_a_study_option(weights, tmp_path, gpt2_ranks, text_file):
    """A scheme in place of GPT-2's learned table from the start (ALiBi), and a switch to RoPE after a step of
    GPT-2's own (its learned table kept, as test_a_gpt2_layout_file_gives_gpt2s_logits holds it)."""
    directory, _ = weights
    argv = ["--config", "configs/finetune_gpt2.yaml", "--out_dir", str(tmp_path / "report"),
            "--schemes", "[alibi]", "--run.model.init_from", str(directory),
            "--run.model.n_layer", str(LAYERS), "--run.model.n_head", str(HEADS), "--run.model.n_embd", str(WIDTH),
            "--run.model.block_size", "32", "--run.model.attn_backend", "auto", "--run.data.input", str(text_file),
            "--run.data.tiktoken_ranks", str(gpt2_ranks), "--run.data.prepared_root", str(tmp_path / "prepared"),
            "--variants", "[{name: learned-then-rope, train: {switch_at: 1, switch_model: {pos_encoding: rope}}}]",
            "--run.train.max_steps", "2", "--run.train.batch_size", "2", "--run.train.eval_interval", "2",
            "--run.train.compile", "false", "--run.train.logger", "none", "--eval.lengths", "[32, 64]",
            "--eval.token_budget", "64",
            "--eval.batch_tokens", "256", "--eval.progress", "false"]  # fmt: skip
    cli.run(extrapolation.COMMAND, argv)
    report = (tmp_path / "report" / "results.md").read_text()
    assert "| alibi |" in report and "| learned-then-rope |" in report  # GPT-2's table replaced, or switched from


def test_hugging_faces_gpt2_gives_the_same_logits():
    """Never ran here: needs transformers and OpenAI's weights in the Hugging Face cache."""
    transformers = pytest.importorskip("transformers")
    try:
        path = weights_file("gpt2")
    except PretrainedError:
        pytest.skip("no gpt2 weights in the Hugging Face cache")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(path.parent).eval()
    ours = from_pretrained(GPTConfig(bias=True, gelu_approximate="tanh", init_from="gpt2")).eval()
    idx = torch.randint(0, 50257, (1, 64))
    with torch.no_grad():
        assert torch.allclose(ours(idx)[0][..., :50257], theirs(idx).logits, atol=1e-3)


def test_a_config_json_cut_short_is_one_line_naming_it(weights, tmp_path, gpt2_ranks, text_file, capsys):
    """train.py --model.init_from DIR whose config.json is cut short (or not an object): one line
    naming the file and the fix, where a JSONDecodeError's traceback was."""
    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((weights[0] / "model.safetensors").read_bytes())
    (directory / "config.json").write_text('{"n_head": 2, "n_la')
    argv = ["--model.init_from", str(directory), "--model.n_layer", str(LAYERS), "--model.n_head", str(HEADS),
            "--model.n_embd", str(WIDTH), "--model.block_size", "32", "--data.input", str(text_file),
            "--data.tokenizer", "gpt2", "--data.tiktoken_ranks", str(gpt2_ranks),
            "--data.prepared_root", str(tmp_path / "prepared"), "--train.out_dir", str(tmp_path / "runs"),
            "--train.max_steps", "1", "--train.compile", "false"]  # fmt: skip
    line = cli_error(capsys, TRAIN, argv)
    assert f"{directory / 'config.json'} is not valid JSON (Unterminated string" in line
    assert "Fetch it again from where the weights came from, or delete it and pass the head count as" in line
    (directory / "config.json").write_text("[2]")
    with pytest.raises(PretrainedError, match=r"config.json is not a JSON object\. Fetch it again"):
        from_pretrained(tiny_config(directory))


def _never(*args, **kwargs):
    raise AssertionError("the corpus was prepared before the cheap checks")


@pytest.mark.parametrize("missing", ["tokenizer", "weights", "shape"])
def test_train_checks_tokenizer_and_weights_before_it_prepares_the_corpus(
    missing, weights, tmp_path, text_file, capsys, monkeypatch, request
):
    """Offline, `init_from gpt2` without GPT-2's ranks file or weights (or with weights of another shape)
    stops before the text is tokenized, which for `python-library` takes minutes. (The ranks file is
    needed only past the tokenizer's check: that case runs without ../shared.)"""
    from posgpt.training import run

    gpt2_ranks = None if missing == "tokenizer" else request.getfixturevalue("gpt2_ranks")
    monkeypatch.setattr(run, "prepared_data", _never)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # empty
    source = {"weights": "gpt2"}.get(missing, str(weights[0]))
    ranks = tmp_path / "nowhere.tiktoken" if missing == "tokenizer" else gpt2_ranks
    argv = ["--model.init_from", source, "--model.n_layer", str(LAYERS + (missing == "shape")),
            "--model.n_head", str(HEADS), "--model.n_embd", str(WIDTH), "--model.block_size", "32",
            "--model.bias", "true", "--model.gelu_approximate", "tanh", "--data.input", str(text_file),
            "--data.tokenizer", "gpt2", "--data.tiktoken_ranks", str(ranks),
            "--train.out_dir", str(tmp_path / "runs")]  # fmt: skip
    if source == "gpt2":
        argv += ["--model.n_layer", "12", "--model.n_head", "12", "--model.n_embd", "768"]
    line = cli_error(capsys, TRAIN, argv)
    expected = {"tokenizer": "GPT-2 ranks file not found", "weights": "no model.safetensors in the Hugging Face",
                "shape": "--model.n_layer"}[missing]  # fmt: skip
    assert expected in line, line


def test_a_study_checks_the_weights_before_it_prepares_the_corpus(tmp_path, gpt2_ranks, capsys, monkeypatch):
    """configs/finetune_gpt2.yaml offline: the weights are missing, said before python-library is built."""
    from posgpt.data import corpora
    from posgpt.training import run

    monkeypatch.setattr(run, "prepared_data", _never)
    monkeypatch.setattr(corpora, "build", _never)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    argv = ["--config", "configs/finetune_gpt2.yaml", "--out_dir", str(tmp_path / "report"),
            "--run.data.tiktoken_ranks", str(gpt2_ranks)]  # fmt: skip
    line = cli_error(capsys, extrapolation.COMMAND, argv)
    assert "--run.model.init_from gpt2: no model.safetensors in the Hugging Face cache" in line, line


def test_a_fine_tune_resumes_when_its_starting_weights_are_gone(tmp_path, gpt2_ranks, text_file):
    """A resume restores its own weights: the cheap checks before preparing ask for `init_from`'s weights only
    for a run that starts afresh (the cache pruned, the run copied to another machine)."""
    directory = tmp_path / "gpt2"
    directory.mkdir()
    save_file(gpt2_tensors(), str(directory / "model.safetensors"))
    argv = ["--model.init_from", str(directory), "--model.n_layer", str(LAYERS), "--model.n_head", str(HEADS),
            "--model.n_embd", str(WIDTH), "--model.block_size", "32", "--model.bias", "true",
            "--model.gelu_approximate", "tanh", "--data.input", str(text_file), "--data.tokenizer", "gpt2",
            "--data.tiktoken_ranks", str(gpt2_ranks), "--data.prepared_root", str(tmp_path / "prepared"),
            "--train.out_dir", str(tmp_path / "runs"), "--train.run_name", "ft", "--train.batch_size", "2",
            "--train.logger", "none", "--train.sample_tokens", "0", "--train.eval_tokens", "64",
            "--train.progress_bar", "false"]  # fmt: skip
    cli.run(TRAIN, [*argv, "--train.max_steps", "2"])
    (directory / "model.safetensors").unlink()
    cli.run(TRAIN, [*argv, "--train.max_steps", "4", "--train.resume", "auto"])
    assert torch.load(tmp_path / "runs" / "ft" / "last.ckpt", weights_only=False)["global_step"] == 4
