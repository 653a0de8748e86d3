"""The attention layer's own options (grouped KV heads, QK-norm, the output gate, sink logits, the soft-cap) against
a float64 formula written from their papers' code, key by key: the layer's output, its weights and, on every CPU
kernel that runs them, its gradients; the refusals; GPT-2 weights; the KV cache a grouped model keeps."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, GPTConfig
from posgpt.model.pretrained import check_gpt2_shape

from helpers import fidelity, is_flex, layer_variants, uncompiled_flex

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, pos_encoding="rope", bias=True)
T, BASE = 7, 10000.0


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + eps)


def rotated(x: torch.Tensor, position: int, base: float = BASE) -> torch.Tensor:
    """RoPE with pairs (m, m + D/2) turned by position * base^(-2m/D) (GPT-NeoX's rotate-half), the angle in
    float32 as the model's table holds it (tests/test_fidelity_table.py checks that table)."""
    half = x.numel() // 2
    out = x.clone()
    for m in range(half):
        f32 = torch.float32
        angle = position * torch.tensor(base, dtype=f32) ** -(torch.tensor(2 * m, dtype=f32) / x.numel())
        cos, sin = float(angle.cos()), float(angle.sin())
        a, b = x[m], x[m + half]
        out[m], out[m + half] = a * cos - b * sin, b * cos + a * sin
    return out


def formula(x: torch.Tensor, attn: torch.nn.Module, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output (T, C) and weights (H, T, T) for one row x (T, C), token by token and head by head, for
    a layer of `config` (a layout: its kind's): keys j <= i, in a window i - j < W or the sinks j < S, or in the chunk
    i // C == j // C (Llama 4's `create_chunked_attention_mask`); RoPE at the layer's base, or none (NoPE);
    Qwen3 / Gemma 3's learned RMSNorm of q and k before RoPE (eps 1e-6), Llama 4's weightless one after (1e-5), on
    rotating layers; Llama 4's query scale log(floor((i + 1) / F) + 1) 0.1 + 1 after them;
    query head h reads KV head h // (H / H_kv) (gpt-oss's q.view(n_kv, q_mult)); s = q.k / sqrt(D), capped
    c tanh(s / c) (Gemma); weights exp(s) / (exp(sink_h) + sum exp(s)) (gpt-oss's sdpa); the output per head times
    sigmoid(x W_g), per element or per head (gated_attention's Qwen3), then the output projection."""
    H, D, C, T = config.n_head, config.head_dim, config.n_embd, x.size(0)
    kv = config.kv_heads
    w, b = attn.qkv.weight, attn.qkv.bias
    out_heads = []
    weights = torch.zeros(H, T, T, dtype=torch.float64)
    for h in range(H):
        g = h // (H // kv)
        q_rows = slice(h * D, (h + 1) * D)
        k_rows, v_rows = slice(C + g * D, C + (g + 1) * D), slice(C + kv * D + g * D, C + kv * D + (g + 1) * D)
        qs, ks, vs = [], [], []
        for i in range(T):
            q, k, v = (w[rows] @ x[i] + b[rows] for rows in (q_rows, k_rows, v_rows))
            if config.qk_norm == "gemma3":
                q, k = rms(q, 1e-6) * attn.q_norm.weight, rms(k, 1e-6) * attn.k_norm.weight
            if config.pos_encoding == "rope":
                q, k = rotated(q, i, config.rope_base), rotated(k, i, config.rope_base)
                if config.qk_norm == "llama4":
                    q, k = rms(q, 1e-5), rms(k, 1e-5)
            if config.attn_temperature_floor:
                q = q * (math.log(math.floor((i + 1) / config.attn_temperature_floor) + 1) * 0.1 + 1)
            qs.append(q), ks.append(k), vs.append(v)
        rows = []
        for i in range(T):
            window, chunk = config.attn_window, config.attn_chunk
            keys = [j for j in range(i + 1) if (not window or i - j < window or j < config.attn_sinks)
                    and (not chunk or i // chunk == j // chunk)]  # fmt: skip
            s = torch.stack([qs[i] @ ks[j] / math.sqrt(D) for j in keys])
            if config.attn_softcap:
                s = config.attn_softcap * torch.tanh(s / config.attn_softcap)
            normaliser = torch.exp(s).sum() + (torch.exp(attn.sinks[h]) if config.attn_sink_logits else 0.0)
            p = torch.exp(s) / normaliser
            weights[h, i, keys] = p.detach()
            o = p @ torch.stack([vs[j] for j in keys])
            if config.attn_gate != "none":
                gate = torch.sigmoid(attn.gate.weight @ x[i] + attn.gate.bias)
                o = o * (gate[h * D : (h + 1) * D] if config.attn_gate == "elementwise" else gate[h])
            rows.append(o)
        out_heads.append(torch.stack(rows))
    y = torch.cat(out_heads, dim=-1)  # (T, C), heads in order
    return y @ attn.proj.weight.T + attn.proj.bias, weights


def layer_run(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention layer's input and output in a forward pass of `model`."""
    seen = {}
    handle = model.blocks[0].attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    model(idx)
    handle.remove()
    return seen["x"], seen["y"]


def stressed(config: GPTConfig, backend: str) -> GPT:
    """A float64 model whose options all act: scores of several units (the cap bites), sinks, norm scales and gates
    away from their starting values."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(config, attn_backend=backend)).double()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.qkv.weight.mul_(40)
        for p in (attn.sinks, attn.gate.weight if attn.gate is not None else None):
            if p is not None:
                p.normal_(0, 1)
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None and norm.weight is not None:
                norm.weight.uniform_(0.5, 2)
    return model


OPTIONS = {label: fields for label, fields in layer_variants(CONFIG).items() if "layout" not in fields}  # one layer
VARIANTS = {**OPTIONS, "all": {"n_kv_head": 2, "qk_norm": "llama4", "attn_gate": "elementwise",
                               "attn_sink_logits": True, "attn_softcap": 2.0}}  # fmt: skip


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
@fidelity(
    "`n_kv_head` (grouped-query attention)",
    paper="Ainslie et al. 2023 (GQA); Shazeer 2019 (MQA)",
    code=(
        "openai/gpt-oss `gpt_oss/torch/model.py` (`q.view(n_kv, q_mult)`), meta-llama/llama-models llama4 "
        "(`repeat_interleave`)"
    ),
    default="off (n_head); query head h reads KV head h // (n_head / n_kv_head)",
    deviations="GPT-2 weights are not mean-pooled into groups: refused (no option)",
)
@fidelity(
    "`qk_norm: gemma3`",
    paper="Gemma 3 (2025), Qwen3",
    code="google-deepmind/gemma `gm/nn/_layers.py` `RMSNorm`, `_modules.py` (before RoPE)",
    default="off; q and k RMS-normalised per head before RoPE, a learned scale per dimension, eps 1e-6",
    deviations=(
        "the scale is a weight from 1 (Qwen3's form), Gemma's 1 + scale from 0: the same function and gradients (no "
        "option)"
    ),
)
@fidelity(
    "`qk_norm: llama4`",
    paper="Llama 4 (2025)",
    code="meta-llama/llama-models `models/llama4/model.py` (`rmsnorm` after RoPE, `use_qk_norm and not is_nope_layer`)",
    default="off; rotated q and k RMS-normalised, no weight, eps 1e-5, on rotating layers only",
    deviations="none",
)
@fidelity(
    "`attn_gate: elementwise`, `headwise`",
    paper="Qiu et al. 2025 (gated attention)",
    code="qiuzh20/gated_attention `modeling_qwen3.py` (gate columns of `q_proj`)",
    default="off; output per head × sigmoid(W x), x the normed layer input, before the output projection",
    deviations=(
        "W is its own Linear, where theirs are extra `q_proj` columns: the same function (no option); its bias follows"
        " `bias`"
    ),
)
@fidelity(
    "`attn_sink_logits`",
    paper="gpt-oss (OpenAI 2025)",
    code="openai/gpt-oss `gpt_oss/torch/model.py` `sdpa` (`cat([QK, S])`, softmax, drop the last column)",
    default=(
        "off; a logit z_h per head in the normaliser of the scaled, masked scores; init N(0, 0.02²) (Hugging Face's "
        "`_init_weights`: the official code only loads them)"
    ),
    deviations="none",
)
@fidelity(
    "`attn_softcap`",
    paper="Gemma 2 (2024)",
    code="google-deepmind/gemma `gm/nn/_modules.py` (`tanh(logits / cap) * cap` before the mask)",
    default="off; c tanh(s / c) of the scaled score, before a position bias and the mask",
    deviations="none (Gemma has no bias scheme: the cap comes first here)",
)
def test_every_softmax_kernel_is_the_formula_with_its_weights_and_gradients(fields, monkeypatch):
    uncompiled_flex(monkeypatch)
    config = dataclasses.replace(CONFIG, **fields)
    idx = torch.randint(0, CONFIG.vocab_size, (1, T))
    checked = []
    for name, kernel in ATTENTIONS["softmax"].kernels.items():
        try:
            model = stressed(dataclasses.replace(config, attn_backend=name), name)
        except ConfigError:  # a kernel that lacks an option is refused (test_refusals)
            continue
        with_grad = kernel.backward_devices is None or "cpu" in kernel.backward_devices  # flex: forward only
        with torch.set_grad_enabled(with_grad):
            x, y = layer_run(model, idx)
        attn = model.blocks[0].attn
        expected, weights = formula(x[0], attn, config)
        torch.testing.assert_close(y[0], expected, rtol=1e-9, atol=1e-10, msg=name)
        checked.append(name)
        if kernel.weights:  # the maps: the formula's weights, summing to less than 1 with sink logits
            maps: list[torch.Tensor] = []
            model.attention_weights(idx, lambda layer, maps=maps: lambda rows, w: maps.append(w))
            torch.testing.assert_close(torch.cat(maps, 2)[0], weights, rtol=1e-9, atol=1e-12)
        if not with_grad:
            continue
        cotangent = torch.randn_like(expected)
        params = [p for p in attn.parameters()]
        mine = torch.autograd.grad((y[0] * cotangent).sum(), params, retain_graph=True)
        theirs = torch.autograd.grad((formula(x[0], attn, config)[0] * cotangent).sum(), params)
        for p_name, a, b in zip([n for n, _ in attn.named_parameters()], mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"{name}: {p_name}")
    assert "eager" in checked and "flex" in checked


def test_sink_logits_take_mass_and_the_cap_bounds_every_score():
    model = stressed(dataclasses.replace(CONFIG, attn_sink_logits=True, attn_softcap=2.0), "eager")
    got = []
    model.attention_weights(torch.randint(0, 64, (1, T)), lambda layer: lambda rows, w: got.append(w))
    weights = torch.cat(got, 2)[0]  # (H, T, T)
    mass = weights.sum(-1)
    assert bool((mass < 1).all()) and bool((mass > 0).all())
    for i in range(T):  # no two capped scores differ by more than 2c: nor do their weights by more than e^2c
        seen = weights[:, i, : i + 1]
        assert bool((seen.amax(-1) / seen.amin(-1) <= math.exp(4) + 1e-9).all())


@fidelity("`n_kv_head` (grouped-query attention)")
def test_grouped_heads_read_their_group_on_every_function_and_kernel(monkeypatch):
    """A model with H_kv KV heads computes what one with H heads computes whose KV heads h repeat head
    h // (H / H_kv): for every attention function, on each of its kernels that runs on a CPU."""
    uncompiled_flex(monkeypatch)
    idx = torch.randint(0, 64, (2, 9))
    H, D, C, kv = CONFIG.n_head, CONFIG.head_dim, CONFIG.n_embd, 2
    for function, layer in ATTENTIONS.items():
        for name, kernel in layer.kernels.items():
            if not is_flex(kernel) and kernel.devices is not None and "cpu" not in kernel.devices:
                continue  # fla's without Triton's interpreter (tests/test_fla.py)
            try:
                grouped = GPT(dataclasses.replace(CONFIG, attention=function, attn_backend=name, n_kv_head=kv)).eval()
            except ConfigError:
                continue
            full = GPT(dataclasses.replace(grouped.config, n_kv_head=None)).eval()
            state = grouped.state_dict()
            for key in [k for k in state if k.endswith("qkv.weight") or k.endswith("qkv.bias")]:
                q, k, v = state[key].split([C, kv * D, kv * D])
                heads = torch.tensor([h // (H // kv) for h in range(H)])
                k, v = (t.unflatten(0, (kv, D))[heads].flatten(0, 1) for t in (k, v))
                state[key] = torch.cat([q, k, v])
            full.load_state_dict(state)
            with torch.no_grad():
                torch.testing.assert_close(grouped(idx)[0], full(idx)[0], msg=f"{function}/{name}")


def test_a_grouped_model_keeps_its_kv_heads_in_the_cache():
    """The KV cache holds n_kv_head heads: n_head / n_kv_head times fewer bytes, measured on the buffers."""
    sizes = {}
    for kv in (None, 2, 1):
        model = GPT(dataclasses.replace(CONFIG, n_layer=2, n_kv_head=kv))
        cache = model.new_cache(32, batch=2)
        sizes[kv] = sum(layer.kv.nbytes for layer in cache.layers)  # keys and values
    assert sizes[None] == 2 * sizes[2] == 4 * sizes[1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_kv_head": 3}, r"n_kv_head must divide n_head \(4\).*pick one of \[1, 2, 4\]"),
        ({"attention": "linear", "attn_sink_logits": True}, r"cannot run attn_sink_logits=True.*softmax or forgetting"),
        ({"attention": "linear", "attn_softcap": 2.0}, r"cannot run attn_softcap=2.0"),
        ({"attention": "sigmoid", "attn_sink_logits": True}, r"softmax mass with no key"),
        ({"attention": "differential", "attn_sink_logits": True}, r"the difference of two"),
        ({"attn_backend": "sdpa", "attn_softcap": 2.0}, r"attn_backend auto, eager or flex would run"),
        (
            {"pos_encoding": "alibi", "qk_norm": "llama4"},
            r"qk_norm='llama4'.*no layer here rotates.*use pos_encoding='rope'",
        ),
        (
            {"attention": "linear", "qk_norm": "gemma3"},
            r"qk_norm acts on the queries of a score",
        ),
        ({"attn_softcap": -1.0}, r"attn_softcap must be >= 0"),
    ],
)
def test_refusals(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(CONFIG, **fields)


def test_gpt2_weights_need_every_head_for_keys_and_values():
    gpt2 = GPTConfig(n_head=12, n_embd=768, bias=True, gelu_approximate="tanh")
    check_gpt2_shape(dataclasses.replace(gpt2, init_from="gpt2"))
    with pytest.raises(ConfigError, match=r"differs in n_kv_head: pass .*--model.n_kv_head 12"):
        check_gpt2_shape(dataclasses.replace(gpt2, init_from="gpt2", n_kv_head=4))
