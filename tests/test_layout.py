"""Per-layer layouts (model/layout.py): every layer of a layout model against the float64 formula of its kind
(window, chunk, RoPE base, NoPE, Llama 4's query scale), on every CPU softmax kernel, with gradients; the chunked
mask; what each kind's cache keeps; the refusals; the shipped layout configs from the command line."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from test_layer_options import formula

import attention_maps as maps_script
import sample as sample_script
import train as train_script
from posgpt.core import cli
from posgpt.core.errors import ConfigError
from posgpt.evaluation.checkpoint import load_checkpoint
from posgpt.model import ATTENTIONS, GPT, GPTConfig
from posgpt.model.attention.softmax import temperature
from posgpt.model.config import model_tags
from posgpt.model.masks import AttentionMask
from posgpt.training.config import RunConfig, TrainConfig
from posgpt.training.run import run_dir_of

from helpers import fidelity, uncompiled_flex

BASE = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, pos_encoding="rope", bias=True)
LAYOUTS = {
    "gemma3": {"layout": ("local", "local", "global"), "qk_norm": "gemma3", "n_kv_head": 2,
               "kinds": {"local": {"attn_window": 3, "rope_base": 100.0}, "global": {"rope_base": 1e6}}},
    "irope": {"layout": ("local", "global"), "qk_norm": "llama4",
              "kinds": {"local": {"attn_chunk": 3}, "global": {"pos_encoding": "none", "attn_temperature_floor": 2}}},
    "hybrid-sinks": {"layout": ("local", "global"), "attn_sink_logits": True,
                     "kinds": {"local": {"attn_window": 2, "attn_sinks": 1}, "global": {"pos_encoding": "none"}}},
}  # fmt: skip
T = 9


def stressed(config: GPTConfig) -> GPT:
    """A float64 model whose every option acts in every layer (see test_layer_options.stressed)."""
    torch.manual_seed(0)
    model = GPT(config).double()
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            attn.qkv.weight.mul_(40)
            if attn.sinks is not None:
                attn.sinks.normal_(0, 1)
            for norm in (attn.q_norm, attn.k_norm):
                if norm is not None and norm.weight is not None:
                    norm.weight.uniform_(0.5, 2)
    return model


@pytest.mark.parametrize("name", LAYOUTS)
@fidelity(
    "`layout`, `kinds` (Gemma 3)",
    paper="Gemma Team 2025",
    code=(
        "google-deepmind/gemma `gm/nn/_config.py` (`make_attention_layers_types`), `_gemma.py` "
        "(`GEMMA3_ATTENTION_PATTERN`), `_transformer.py` (base per layer)"
    ),
    default=(
        "off; the pattern repeated over the layers and cut; a kind's window W sees keys i − W < j ≤ i (Gemma's `k > q "
        "− W`)"
    ),
    deviations=(
        "Gemma 3 trains its global layers with linear RoPE scaling ×8 (4B and up): a kind may set `rope_scaling`, "
        "which the shipped config leaves out at its length"
    ),
)
@fidelity(
    "`layout`, `kinds` (RoPE/NoPE hybrid)",
    paper="Yang et al. 2025",
    code="Hugging Face transformers `models/cohere2` (`sliding_window_pattern` 4, RoPE only on sliding layers)",
    default="off; layers 3, 7, ... global and without positions",
    deviations="Cohere's parallel attention-MLP block not offered (no option)",
)
@fidelity("`attn_temperature_floor` (iRoPE)")
def test_every_layer_is_its_kinds_formula_on_every_softmax_kernel(name, monkeypatch):
    uncompiled_flex(monkeypatch)
    idx = torch.randint(0, BASE.vocab_size, (1, T))
    checked = []
    for backend, kernel in ATTENTIONS["softmax"].kernels.items():
        try:
            model = stressed(dataclasses.replace(BASE, attn_backend=backend, **LAYOUTS[name]))
        except ConfigError:
            continue
        with_grad = kernel.backward_devices is None or "cpu" in kernel.backward_devices  # flex: forward only
        seen: dict[int, tuple] = {}
        hooks = [block.attn.register_forward_hook(lambda m, a, out, i=i, seen=seen: seen.update({i: (a[0], out)}))
                 for i, block in enumerate(model.blocks)]  # fmt: skip
        with torch.set_grad_enabled(with_grad):
            model(idx)
        for hook in hooks:
            hook.remove()
        for i, kind in enumerate(model.kind_of):
            x, y = seen[i]
            expected, _ = formula(x[0], model.blocks[i].attn, kind.config)
            torch.testing.assert_close(y[0], expected, rtol=1e-9, atol=1e-10, msg=f"{backend}, layer {i}")
            if with_grad:
                params = list(model.blocks[i].attn.parameters())
                cotangent = torch.randn_like(expected)
                mine = torch.autograd.grad((y[0] * cotangent).sum(), params, retain_graph=True)
                theirs = torch.autograd.grad((expected * cotangent).sum(), params)
                for a, b in zip(mine, theirs, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"{backend}, layer {i}")
        checked.append(backend)
    assert "eager" in checked and "flex" in checked


@fidelity("`layout`, `kinds` (Gemma 3)")
def test_a_layout_repeats_its_pattern_and_cuts_it_where_the_layers_end():
    config = dataclasses.replace(BASE, n_layer=8, layout=("a", "a", "a", "b", "c"),
                                 kinds={"a": {"attn_window": 4}, "b": {}, "c": {"pos_encoding": "none"}})  # fmt: skip
    model = GPT(config)
    assert [kind.name for kind in model.kind_of] == ["a", "a", "a", "b", "c", "a", "a", "a"]
    assert [block.attn.mask.window for block in model.blocks] == [4, 4, 4, 0, 0, 4, 4, 4]
    assert sorted(model.kind_pe) == ["c"]  # the other kinds attend with the model's RoPE


@fidelity(
    "`attn_chunk` (iRoPE)",
    paper="Llama 4 (2025)",
    code="meta-llama/llama-models `models/llama4/model.py` (`create_chunked_attention_mask`; `nope_layer_interval`)",
    default="off; key j visible to query i iff j ≤ i and ⌊i/C⌋ = ⌊j/C⌋; a decoding cache of C keys",
    deviations=(
        "Llama 4 builds the chunked mask only for prompts (a one-token decode step there sees every cached key); here "
        "decoding masks as training does (no option)"
    ),
)
def test_the_chunked_mask_and_its_seen_keys_by_hand():
    mask = AttentionMask(chunk=3)
    q, k = torch.arange(7)[:, None], torch.arange(7)[None, :]
    expected = torch.tensor([[j <= i and i // 3 == j // 3 for j in range(7)] for i in range(7)])
    assert torch.equal(mask.visible(q, k), expected)
    assert mask.seen_keys(torch.arange(7)).tolist() == [1, 2, 3, 1, 2, 3, 1]
    assert mask.attended_keys(100) == 3 and mask.rolling and not mask.causal_only


@fidelity(
    "`attn_temperature_floor` (iRoPE)",
    paper="Llama 4 (2025)",
    code="meta-llama/llama-models `models/llama4/model.py` (`attn_temperature_tuning`, `floor_scale`, `attn_scale`)",
    default=(
        "off; q × (ln(⌊(p + 1)/F⌋ + 1) · 0.1 + 1), p from 0, after RoPE and QK-norm; Llama 4 sets F = 8192 on its NoPE"
        " layers"
    ),
    deviations="F an option (8192 leaves a CPU model's scale at 1); allowed on any kind (Llama 4: NoPE layers only)",
)
def test_llama4s_query_scale_is_one_until_the_floor_then_grows_with_its_log():
    scale = temperature(torch.arange(20), 8).tolist()
    expected = [math.log(math.floor((p + 1) / 8) + 1) * 0.1 + 1 for p in range(20)]
    assert scale == pytest.approx(expected, abs=1e-7) and scale[6] == 1.0 and scale[7] > 1.0


@fidelity("`attn_chunk` (iRoPE)")
def test_each_kind_keeps_its_own_keys_in_the_cache():
    """A local layer keeps its window (plus sinks), a chunked one a chunk, a global one every key; a grouped
    model's key/value heads; cached decoding past every window and chunk gives the uncached logits."""
    kinds = {"w": {"attn_window": 4, "attn_sinks": 1}, "c": {"attn_chunk": 5}, "g": {}}
    config = dataclasses.replace(BASE, n_layer=3, n_kv_head=2, layout=("w", "c", "g"), kinds=kinds)
    model = GPT(config).eval()
    cache = model.new_cache(32, batch=2)
    assert [part.capacity for part in cache.parts] == [5, 5, 32] and cache.pos is not None  # one position per row
    assert [tuple(layer.kv[0].shape) for layer in cache.layers] == [(2, 2, 5, 8), (2, 2, 5, 8), (2, 2, 32, 8)]
    idx = torch.randint(0, 64, (2, 23))
    with torch.no_grad():
        full, _ = model(idx)
        steps = [model(idx[:, :6], cache=cache)[0]]
        steps += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(6, 23)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert not model.constant_memory()
    assert GPT(dataclasses.replace(config, kinds={**config.kinds, "g": {"attn_window": 2}})).constant_memory()


@pytest.mark.parametrize("name", LAYOUTS)
def test_cached_decoding_of_each_layout_gives_the_logits_of_one_full_forward(name):
    """Past every window and chunk, with Llama 4's query scale at the cache's positions, grouped heads and sinks."""
    model = GPT(dataclasses.replace(BASE, **LAYOUTS[name])).eval()
    idx = torch.randint(0, 64, (2, 20))
    cache = model.new_cache(32, batch=2)
    with torch.no_grad():
        steps = [model(idx[:, :5], cache=cache)[0]] + [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 20)]
        torch.testing.assert_close(torch.cat(steps, 1), model(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layout": ("a", "b"), "kinds": {"a": {}}}, r"names kind\(s\) \['b'\] that kinds does not define"),
        ({"layout": ("a",), "kinds": {"a": {}, "b": {}}}, r"defines \['b'\], which the layout never uses"),
        ({"kinds": {"a": {}}}, r"kinds says what each kind of a layout sets: set layout too"),
        ({"layout": ()}, r"^GPTConfig.layout \[\] names no kind: list each layer's kind"),  # issue 57: trained plain
        ({"layout": (), "kinds": {"a": {}}}, r"layout \[\] names no kind"),  # not "set layout too": it was set
        ({"layout": ("a",), "kinds": {"a": {"rope_bse": 2.0}}}, r"sets rope_bse, .*; did you mean rope_base\?$"),
        ({"layout": ("a",), "kinds": {"a": {"pos_encoding": "learned"}}}, r"acts once on the embeddings"),
        ({"layout": ("a",), "kinds": {"a": {"n_head": 2}}}, r"sets n_head, which a kind cannot set; a kind sets"),
        ({"layout": ("a",), "kinds": {"a": {"attn_window": 2, "attn_chunk": 2}}},
         r"kinds\['a'\]: GPTConfig.attn_chunk and attn_window are two local masks"),
        ({"layout": ("a",), "kinds": {"a": {"attn_window": 2}}, "attention": "linear"},
         r"kinds\['a'\]: attention='linear' cannot run attn_window=2"),
    ],
)  # fmt: skip
def test_refusals(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(BASE, **fields)


def test_rope_scaling_of_a_layout_with_several_bases_is_refused_and_of_one_base_stretches_every_kind():
    gemma = GPT(dataclasses.replace(BASE, **LAYOUTS["gemma3"]))
    assert not gemma.rescalable  # kinds at bases 100 and 1e6: evaluation skips the scaling
    with pytest.raises(ValueError, match=r"at one base\) has no scaling.*evaluate this model without rope_scaling"):
        gemma.rescaled("linear", 2.0)
    hybrid = GPT(dataclasses.replace(BASE, **LAYOUTS["hybrid-sinks"])).eval()
    view = hybrid.rescaled("linear", 2.0)
    schemes = [view.pe_of(kind) for kind in view.kinds]
    assert [pe.scaling[:2] for pe in schemes if pe.rescalable] == [("linear", 2.0)]
    assert hybrid.pe.scaling[:2] == ("none", 1.0)  # the model itself is as it was


def test_a_switch_that_changes_the_layout_or_the_kv_heads_is_refused_and_drope_switches_every_kind():
    model = GPT(dataclasses.replace(BASE, **LAYOUTS["hybrid-sinks"]))
    for change in ({"layout": ("local",), "kinds": {"local": {"attn_chunk": 3}}}, {"n_kv_head": 2}):
        with pytest.raises(ValueError, match=f"not .*{next(iter(change))}"):
            model.switch(dataclasses.replace(model.config, **change))
        with pytest.raises(ValueError, match=f"train.switch_model cannot change .*{next(iter(change))}"):
            RunConfig(model=model.config, train=TrainConfig(switch_at=0.5, switch_model=change))
    dropped = dataclasses.replace(model.config, pos_encoding="none")  # DroPE: the local layers' RoPE goes too
    model.switch(dropped)
    fresh = GPT(dropped)
    fresh.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(model(idx)[0], fresh(idx)[0])
    assert all(not model.pe_of(kind).uses_positions for kind in model.kinds)


ROOT = Path(__file__).resolve().parents[1]
LAYOUT_CONFIGS = sorted(path.name for path in (ROOT / "configs").glob("*.yaml")
                        if "layout" in ((yaml.safe_load(path.read_text()) or {}).get("model") or {}))  # fmt: skip


def test_eight_layout_configs_ship():
    assert LAYOUT_CONFIGS == [
        "gemma3_layout.yaml",
        "gpt_oss_layout.yaml",
        "irope.yaml",
        "kimi_linear.yaml",
        "olmo3_yarn.yaml",
        "olmo_hybrid.yaml",
        "qwen3_next.yaml",
        "rope_nope_hybrid.yaml",
    ]


def test_a_layout_and_the_layer_options_name_the_run_and_a_plain_models_name_stays():
    """Issue 57: every layout config trained into <corpus>-char-rope, the default model's run directory."""
    data = SimpleNamespace(name="tiny-char")
    assert run_dir_of(RunConfig(), data) == Path("runs/tiny-char-rope")  # the README's commands still match
    names = {name: run_dir_of(cli.parse(train_script.COMMAND, ["--config", f"configs/{name}"]), data).name
             for name in LAYOUT_CONFIGS}  # fmt: skip
    assert names == {
        "gemma3_layout.yaml": "tiny-char-rope-5local-global-n_kv_head=2-qk_norm=gemma3",
        "gpt_oss_layout.yaml": "tiny-char-rope-banded-dense-n_kv_head=1-attn_sink_logits",
        "irope.yaml": "tiny-char-rope-3local-global-n_kv_head=2-qk_norm=llama4",
        "rope_nope_hybrid.yaml": "tiny-char-rope-3local-global",
        "kimi_linear.yaml": "tiny-char-none-3kda-attention",
        "olmo3_yarn.yaml": "tiny-char-rope-3local-global",
        "olmo_hybrid.yaml": "tiny-char-rope-3deltanet-attention",
        "qwen3_next.yaml": "tiny-char-rope-3deltanet-attention-n_kv_head=2",
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUT_CONFIGS)
def test_each_layout_config_trains_samples_and_draws_its_maps(name, tmp_path, text_file, capsys, caplog):
    """Two steps of the config from the command line (narrower: 32 wide), then the sampler, which says what each
    kind's cache keeps, and the attention maps, which name each layer's kind."""
    caplog.set_level(logging.INFO)
    cli.run(train_script.COMMAND, [
        "--config", str(ROOT / "configs" / name), "--model.n_embd", "32", "--model.block_size", "32",
        "--train.batch_size", "4", "--train.max_steps", "2", "--train.eval_interval", "2", "--train.eval_tokens", "128",
        "--train.progress_bar", "false", "--train.logger", "none", "--train.sample_tokens", "0",
        "--train.run_name", "layout", "--train.out_dir", str(tmp_path / "runs"), "--data.input", str(text_file),
        "--data.prepared_root", str(tmp_path / "prepared"),
    ])  # fmt: skip
    ckpt = tmp_path / "runs" / "layout" / "last.ckpt"
    model = load_checkpoint(str(ckpt)).model
    words = ", ".join([model.config.pos_encoding, *model_tags(model.config.to_dict())])  # the layout too
    assert any(f"layers x 32, {words}, block 32)" in record.getMessage() for record in caplog.records), words
    capsys.readouterr()
    cli.run(sample_script.COMMAND, ["--ckpt", str(ckpt), "--prompt", "The", "--max_new_tokens", "40"])
    said = capsys.readouterr().err
    for kind in model.kinds:  # a delta rule's kinds keep a constant state
        held = f"{kind.mask.ring + kind.mask.sinks} keys" if kind.mask.rolling else "every key"
        held = f" {held}" if kind.attention.takes_positions else ""
        assert f"{kind.name} x{len(kind.layers)}{held}" in said, said
    assert f", {model.config.kv_heads} KV head" in said
    out = tmp_path / "maps"
    cli.run(maps_script.COMMAND, ["--ckpt", str(ckpt), "--prompt", "The cat sat.", "--lengths", "64", "--tokens", "64",
                                  "--out", str(out), "--progress", "false"])  # fmt: skip
    doc = json.loads((out / "results.json").read_text())
    assert doc["prompts"][0]["kinds"] == {str(i): kind.name for i, kind in enumerate(model.kind_of)}
    assert doc["lengths"][0]["kinds"] == [kind.name for kind in model.kind_of]
    assert all((out / "layout" / f"layer{i}.png").is_file() for i in range(model.config.n_layer))


@pytest.mark.gpu
@pytest.mark.parametrize("name", LAYOUTS)
def test_compiled_flex_and_sdpa_run_each_layout_as_eager_does_on_cuda(name):
    """What the CPU checks uncompiled and forward only: each layout's kernels on CUDA (flex compiled, SDPA with
    its own grouped heads) against eager in float32, logits and every gradient, heads of 16 (flex's least)."""
    config = dataclasses.replace(BASE, n_embd=64, block_size=64, **LAYOUTS[name])
    idx = torch.randint(0, 64, (2, 64), device="cuda")
    results = {}
    for backend in ("eager", "flex", "sdpa"):
        try:
            torch.manual_seed(0)
            model = GPT(dataclasses.replace(config, attn_backend=backend)).cuda()
        except ConfigError:  # sdpa lacks sink logits: refused
            continue
        logits, loss = model(idx, idx)
        loss.backward()
        results[backend] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert "flex" in results
    for backend, (logits, grads) in results.items():
        torch.testing.assert_close(logits, results["eager"][0], rtol=1e-4, atol=1e-4, msg=backend)
        for n, grad in grads.items():
            torch.testing.assert_close(grad, results["eager"][1][n], rtol=1e-3, atol=1e-4, msg=f"{backend}: {n}")


def test_a_layout_from_yaml_or_a_checkpoint_is_the_same_config_as_from_the_command_line():
    fields = {"layout": ["a", "b"], "kinds": {"a": {"attn_window": 3}, "b": {}}}  # as config.yaml holds them
    config = dataclasses.replace(BASE, **fields)
    assert config.layout == ("a", "b") and config == dataclasses.replace(BASE, **{**fields, "layout": ("a", "b")})
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="must be a list of kind names"):
        dataclasses.replace(BASE, layout="ab", kinds={"ab": {}})


def test_a_layout_written_as_one_name_in_yaml_is_one_line(tmp_path, capsys):
    (tmp_path / "one.yaml").write_text("model:\n  layout: local\n  kinds: {local: {attn_window: 8}}\n")
    with pytest.raises(SystemExit):
        cli.run(train_script.COMMAND, ["--config", str(tmp_path / "one.yaml")])
    assert capsys.readouterr().err.splitlines()[1] == "error: --model.layout takes a list ([a, b]) or null, got 'local'"


def test_every_scheme_of_a_layout_is_reserved_read_and_kept_where_it_should_be():
    """Random positions and the cache grow every kind's tables; a scaled view rebuilds RoPE only (a learned table
    stays: the same logits at factor 1); a switch keeps a kind's trained scheme while its settings stay."""
    kinds = {"a": {"pos_encoding": "rope", "rope_base": 100.0}}
    learned = GPT(dataclasses.replace(BASE, pos_encoding="learned", layout=("a",), kinds=kinds)).eval()
    idx = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(learned.rescaled("linear", 1.0)(idx)[0], learned(idx)[0])
    hybrid = GPT(dataclasses.replace(BASE, pos_encoding="none", layout=("a", "b"),
                                     kinds={"a": {"pos_encoding": "rope"}, "b": {"pos_encoding": "t5"}}))  # fmt: skip
    assert hybrid.uses_positions  # random positions reach the kinds' schemes
    hybrid.reserve(40)
    hybrid(idx, positions=torch.arange(28, 40)[None])  # past block_size 16: grown
    trained = hybrid.kind_pe["b"]
    hybrid.switch(dataclasses.replace(hybrid.config, pos_encoding="t5"))  # b's settings stay: its T5 table too
    assert hybrid.pe_of(hybrid.kinds[1]) is trained and hybrid.pe is not trained
    with pytest.raises(ConfigError, match="no layer would use the model's pos_encoding='t5' and its parameters"):
        dataclasses.replace(BASE, pos_encoding="t5", layout=("a",), kinds={"a": {"pos_encoding": "alibi"}})


def test_llama4s_query_scale_reads_the_schemes_positions_and_needs_a_dot_product_score():
    model = GPT(dataclasses.replace(BASE, pos_encoding="none", attn_temperature_floor=4)).eval()
    idx = torch.randint(0, 64, (1, 6))
    far, near = (model(idx, positions=torch.arange(s, s + 6)[None])[0] for s in (40, 0))
    assert not torch.allclose(far, near)  # NoPE: only the scale sees the positions
    torch.testing.assert_close(near, model(idx)[0])
    for fields in ({"attention": "linear"}, {"attn_score": "additive"}):
        with pytest.raises(ConfigError, match="attn_temperature_floor"):
            dataclasses.replace(BASE, attn_temperature_floor=4, **fields)


def test_a_config_recorded_with_an_empty_layout_reads_as_no_layout():
    """Checkpoints before issue 57 could record `layout: []` (trained as a plain model): they load as one."""
    recorded = {**GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16).to_dict(), "layout": []}
    assert GPTConfig.from_dict(recorded).layout is None
