"""Gated DeltaNet and KDA (model/attention/delta.py): the chunked form against the recurrent reference in float64
(outputs, final state, gradients), the layers' decoding cache against a full forward, and their refusals."""

import dataclasses
import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from posgpt.core.errors import ConfigError
from posgpt.evaluation.sampling import cache_in_words
from posgpt.model import GPT, GPTConfig
from posgpt.model.attention.delta import CHUNK, DeltaChunked, delta_rule_chunked, delta_rule_recurrent

from helpers import fidelity

BASE = GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32, pos_encoding="none", bias=False)


def inputs(per_channel: bool, T: int = 150, d_k: int = 8, d_v: int = 6, fast: bool = False, seed: int = 0):
    """q, k (normalised, q scaled), v, beta, g, an initial state: float64 leaves that take gradients."""
    gen = torch.Generator().manual_seed(seed)
    B, H = 2, 3

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(rand(B, H, T, d_k), dim=-1) / d_k**0.5
    k = F.normalize(rand(B, H, T, d_k), dim=-1)
    beta = torch.sigmoid(rand(B, H, T))
    g = -F.softplus(rand(B, H, T, d_k if per_channel else 1))
    if fast:  # some channels (or heads) forget almost at once: e^-30 a token, e^-1900 over a chunk
        g[..., :1] = -30.0
    leaves = [q, k, rand(B, H, T, d_v), beta, g, rand(B, H, d_k, d_v)]
    return [t.requires_grad_() for t in leaves]


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("fast", [False, True], ids=["decay", "fast-decay"])
def test_the_chunked_rule_equals_the_recurrent_one_with_its_state_and_gradients(per_channel, fast):
    """Also the kernel's form: in segments (here of one chunk, the last one partial), each recomputed in backward."""
    leaves = inputs(per_channel, fast=fast)
    weights = torch.randn(2, 3, 150, 6, dtype=torch.float64), torch.randn(2, 3, 8, 6, dtype=torch.float64)
    results = []
    for rule in (delta_rule_recurrent, delta_rule_chunked, functools.partial(DeltaChunked.rule, segment=CHUNK)):
        out, state = rule(*leaves)
        loss = (out * weights[0]).sum() + (state * weights[1]).sum()
        results.append([out, state, *torch.autograd.grad(loss, leaves)])
    names = ["out", "state", "dq", "dk", "dv", "dbeta", "dg", "dstate"]
    for form in results[1:]:
        for name, want, got in zip(names, results[0], form, strict=True):
            assert torch.isfinite(got).all(), name
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=name)


def test_a_chunk_of_another_size_and_a_length_under_one_chunk_change_nothing():
    q, k, v, beta, g, state = (t.detach() for t in inputs(True, T=40))
    ref = delta_rule_recurrent(q, k, v, beta, g, state)
    for chunk in (16, 32, 64):
        for got, want in zip(delta_rule_chunked(q, k, v, beta, g, state, chunk=chunk), ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("attention", ["gated_deltanet", "kda"])
def test_the_eager_and_chunked_kernels_give_one_model(attention):
    config = dataclasses.replace(BASE, attention=attention, attn_backend="eager")
    torch.manual_seed(0)
    eager = GPT(config).double()
    chunked = GPT(dataclasses.replace(config, attn_backend="chunked")).double()
    chunked.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 50, (2, 70))
    torch.testing.assert_close(chunked(idx, idx)[0], eager(idx, idx)[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("attention", ["gated_deltanet", "kda"])
def test_cached_decoding_and_a_padded_prefill_equal_the_full_forward(attention):
    """Prefill of unequal prompts (right-padded, `lengths`), then one token at a time and a few at once: each row's
    logits are those of the uncached model on that row alone."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, attention=attention)).double().eval()
    idx = torch.randint(0, 50, (2, 12))
    lengths = torch.tensor([5, 9])
    cache = model.new_cache(capacity=32, batch=2)
    with torch.no_grad():
        model(idx[:, :9], cache=cache, lengths=lengths)
        rows = [idx[0, :5].tolist(), idx[1, :9].tolist()]
        for _ in range(3):  # one token a step
            new = torch.randint(0, 50, (2, 1))
            logits, _ = model(new, cache=cache)
            for b in range(2):
                rows[b].append(int(new[b]))
                full, _ = model(torch.tensor([rows[b]]))
                torch.testing.assert_close(logits[b, -1], full[0, -1], rtol=1e-9, atol=1e-9)
        new = torch.randint(0, 50, (2, 3))  # then three at once
        logits, _ = model(new, cache=cache)
        for b in range(2):
            full, _ = model(torch.tensor([rows[b] + new[b].tolist()]))
            torch.testing.assert_close(logits[b], full[0, -3:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"pos_encoding": "rope"}, "no pair scores for pos_encoding='rope'"),
        ({"pos_encoding": "alibi"}, "no pair scores for pos_encoding='alibi'"),
        ({"attn_window": 8}, "attn_window belongs to the layers that score pairs"),
        ({"qk_norm": "gemma3"}, "qk_norm belongs"),
        ({"n_kv_head": 1}, "n_kv_head belongs"),
        ({"gdn_expand_k": 0.7}, "n_head 2 must split keys 22.4 and values 48 wide into whole heads"),
    ],
)
def test_what_a_delta_rule_layer_refuses(change, words):
    with pytest.raises(ConfigError, match=words):
        dataclasses.replace(BASE, attention="gated_deltanet", **change)


def test_learned_positions_on_the_embeddings_go_with_a_delta_rule_model():
    model = GPT(dataclasses.replace(BASE, attention="kda", pos_encoding="learned"))
    assert model(torch.randint(0, 50, (1, 8)))[0].shape == (1, 8, 50)


def layer_by_the_formula(layer, x: torch.Tensor) -> torch.Tensor:
    """A GDN or KDA layer's output (T, C) for one sequence x (T, C), token by token from its parameters: the
    projections, each channel's causal convolution of width 4 and SiLU, L2 norms, the gates, the delta rule, the
    gated per-head RMSNorm and the output projection."""
    H, d_k, d_v = layer.n_head, layer.d_k, layer.d_v
    T = x.size(0)
    mixed = torch.cat([x @ layer.q_proj.weight.T, x @ layer.k_proj.weight.T, x @ layer.v_proj.weight.T], -1)
    w = layer.conv.weight[:, 0]  # (channels, 4): tap 3 reads the token itself
    conv = [sum(w[:, 3 - d] * mixed[t - d] for d in range(4) if t - d >= 0) for t in range(T)]
    conv = F.silu(torch.stack(conv))
    kda = hasattr(layer, "f_proj")
    S = [torch.zeros(d_k, d_v, dtype=x.dtype) for _ in range(H)]
    out = []
    for t in range(T):
        heads = []
        for h in range(H):
            q = conv[t, h * d_k : (h + 1) * d_k]
            k = conv[t, H * d_k + h * d_k : H * d_k + (h + 1) * d_k]
            v = conv[t, 2 * H * d_k + h * d_v : 2 * H * d_k + (h + 1) * d_v]
            q, k = q / torch.sqrt(q @ q + 1e-6) / math.sqrt(d_k), k / torch.sqrt(k @ k + 1e-6)  # the official l2norm
            beta = torch.sigmoid(layer.b_proj(x[t])[h])
            if kda:
                f = layer.f_proj(x[t])[h * d_k : (h + 1) * d_k] + layer.dt_bias[h * d_k : (h + 1) * d_k]
                decay = torch.exp(-layer.A_log[h].exp() * F.softplus(f))  # one per key channel
            else:
                decay = torch.exp(-layer.A_log[h].exp() * F.softplus(layer.a_proj(x[t])[h] + layer.dt_bias[h]))
            S[h] = (decay * torch.ones(d_k, dtype=x.dtype))[:, None] * S[h]
            S[h] = S[h] + torch.outer(k, beta * (v - S[h].T @ k))
            o = S[h].T @ q
            o = o / torch.sqrt((o * o).mean() + 1e-5) * layer.o_norm.weight
            gate = layer.g_proj(x[t])[h * d_v : (h + 1) * d_v]
            heads.append(o * (torch.sigmoid(gate) if kda else F.silu(gate)))
        out.append(torch.cat(heads) @ layer.proj.weight.T)
    return torch.stack(out)


def run_layer(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """The first layer's output for inputs x (B, T, C), through the model's own plan."""
    seen = {}
    layer = model.blocks[0].attn
    handle = layer.register_forward_hook(lambda module, args, output: seen.setdefault("out", output))
    pre = model.blocks[0].ln_1.register_forward_hook(lambda module, args, output: x)  # the layer's input: x
    try:
        model(torch.zeros(x.shape[:2], dtype=torch.long))
    finally:
        handle.remove()
        pre.remove()
    return seen["out"]


@fidelity(
    "`attention: gated_deltanet`",
    paper="Yang, Kautz & Hatamizadeh 2025 (Gated DeltaNet)",
    code=(
        "NVlabs/GatedDeltaNet `lit_gpt/gated_delta_net.py`; fla-org/flash-linear-attention"
        " `fla/layers/gated_deltanet.py`"
    ),
    default=(
        "S_t = e^{g_t} S_{t−1}, S_t += k_t·β_t(v_t − S_tᵀk_t)ᵀ, o_t = S_tᵀq_t/√d_k; q, k L2-normed after a width-4"
        " causal conv and SiLU; g = −e^{A_log}·softplus(W_a x + dt_bias) per head; output RMSNorm × SiLU(W_g x); keys"
        " 0.75, values 1.5 × n_embd"
    ),
    deviations=(
        "W_b with a bias (NVlabs'; fla has none); `delta_neg_eigval`: β × 2 (fla's allow_neg_eigval); the output"
        " projection starts at GPT-2's residual scale"
    ),
)
def test_a_gated_deltanet_layer_is_its_formula():
    run_formula("gated_deltanet")


@fidelity(
    "`attention: kda`",
    paper="Kimi Team 2025 (Kimi Linear: KDA)",
    code="fla-org/flash-linear-attention `fla/layers/kda.py` (`KimiDeltaAttention`)",
    default=(
        "GDN's rule with a decay per key channel, g = −e^{A_log[h]}·softplus(W_f x + dt_bias), W_f low-rank (n_embd →"
        " d_v → keys); output RMSNorm × σ(W_g x), W_g low-rank with a bias; heads n_embd / n_head wide"
    ),
    deviations="`kda_expand_v` sets the value heads (fla's expand_v, 1); `delta_neg_eigval`: β × 2",
)
def test_a_kda_layer_is_its_formula():
    run_formula("kda")


def run_formula(attention: str) -> None:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, attention=attention, n_layer=1)).double()
    layer = model.blocks[0].attn
    with torch.no_grad():
        layer.o_norm.weight.normal_()  # not ones: the norm's weight counts
        x = torch.randn(2, 70, 32, dtype=torch.float64)
        expected = torch.stack([layer_by_the_formula(layer, x[b]) for b in range(2)])
        torch.testing.assert_close(run_layer(model, x), expected, rtol=1e-9, atol=1e-10)


QWEN3_NEXT = dataclasses.replace(
    BASE, n_layer=4, n_head=4, n_embd=32, n_kv_head=2, pos_encoding="rope", rope_fraction=0.25, rope_partial="neox",
    layout=("gdn", "gdn", "gdn", "attn"),
    kinds={"gdn": {"attention": "gated_deltanet"}, "attn": {"qk_norm": "gemma3", "attn_gate": "elementwise"}},
)  # fmt: skip
KIMI = dataclasses.replace(
    BASE, n_layer=4, layout=("kda", "kda", "kda", "nope"),
    kinds={"kda": {"attention": "kda"}, "nope": {"pos_encoding": "none"}}, pos_encoding="rope",
)  # fmt: skip


def test_a_kind_chooses_its_function_and_a_delta_rule_kind_takes_none_of_the_models_positions():
    model = GPT(QWEN3_NEXT)
    gdn, attn = model.kinds
    assert [type(block.attn).__name__ for block in model.blocks] == ["GatedDeltaNet"] * 3 + ["SoftmaxAttention"]
    assert (gdn.config.pos_encoding, gdn.config.n_kv_head, gdn.mask.causal_only) == ("none", None, True)
    assert (attn.config.pos_encoding, attn.config.n_kv_head, attn.config.rope_fraction) == ("rope", 2, 0.25)
    softmax = model.blocks[3].attn
    assert softmax.gate is not None and softmax.q_norm is not None and softmax.n_kv_head == 2
    assert model.pe_of(gdn).uses_positions is False and model.pe_of(attn).rotates
    assert cache_in_words(model) == "kv cache: attn x1 every key, 2 KV heads; constant state: gdn x3"


HYBRID_CONFIGS = ["qwen3_next.yaml", "kimi_linear.yaml", "olmo_hybrid.yaml"]


def shipped(name: str) -> GPTConfig:
    """A shipped config's model, 32 wide, on this test's vocabulary and block size."""
    fields = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / name).read_text())["model"]
    return GPTConfig(**{**fields, "layout": tuple(fields["layout"]), "n_embd": 32, "vocab_size": 50, "block_size": 32})


@fidelity(
    "`kinds: {attention}` (recurrent hybrids)",
    paper="Qwen3-Next (2025); Kimi Team 2025 (Kimi Linear); Ai2 2025 (OLMo Hybrid)",
    code="transformers `Qwen3NextDecoderLayer` (`layer_types`); fla-org/flash-linear-attention `fla/layers`",
    default=(
        "a layout's kind sets its attention function; 3 Gated DeltaNet or KDA layers : 1 softmax layer in the shipped"
        " configs, the recurrent kinds without the model's scheme, mask or KV heads"
    ),
    deviations="MLA (Kimi Linear's softmax layers), the MoE MLPs and Qwen3-Next's separate value heads left out",
)
@pytest.mark.parametrize("name", HYBRID_CONFIGS)
def test_a_shipped_hybrids_padded_prefill_and_cached_steps_equal_its_full_forward(name):
    """Every kind of each shipped recurrent hybrid, in float64: a right-padded prefill, then one token a step."""
    torch.manual_seed(0)
    model = GPT(shipped(name)).double().eval()
    assert {kind.attention.takes_positions for kind in model.kinds} == {True, False}
    idx = torch.randint(0, 50, (2, 9))
    lengths = torch.tensor([4, 9])
    cache = model.new_cache(capacity=32, batch=2)
    rows = [idx[0, :4].tolist(), idx[1].tolist()]
    with torch.no_grad():
        model(idx, cache=cache, lengths=lengths)
        for _ in range(3):
            new = torch.randint(0, 50, (2, 1))
            logits, _ = model(new, cache=cache)
            for b in range(2):
                rows[b].append(int(new[b]))
                torch.testing.assert_close(logits[b, -1], model(torch.tensor([rows[b]]))[0][0, -1], rtol=1e-9,
                                           atol=1e-9)  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "model_wide", "words"),
    [
        ({"attention": "kda", "pos_encoding": "rope"}, {}, r"kinds\['k'\]: attention='kda' has no pair scores"),
        ({"attention": "kda", "attn_window": 4}, {}, r"kinds\['k'\]: GPTConfig.attn_window belongs"),
        ({"attention": "kda"}, {"attn_backend": "sdpa"}, r"kinds\['k'\]: attn_backend='sdpa' is not a kernel"),
        ({"attention": "kda", "attn_gate": "headwise"}, {}, r"kinds\['k'\]: GPTConfig.attn_gate belongs"),
    ],
)
def test_a_delta_rule_kind_refuses_what_a_model_of_it_refuses_in_one_line_naming_the_kind(kind, model_wide, words):
    with pytest.raises(ConfigError, match=words):
        dataclasses.replace(BASE, pos_encoding="rope", layout=("k", "s"), kinds={"k": kind, "s": {}}, **model_wide)


def test_the_models_layer_options_stay_with_its_pair_scoring_kinds():
    config = dataclasses.replace(
        BASE,
        pos_encoding="rope",
        attn_gate="elementwise",
        attn_softcap=30.0,
        n_kv_head=1,
        qk_norm="gemma3",
        layout=("k", "s"),
        kinds={"k": {"attention": "kda"}, "s": {}},
    )
    delta, softmax = GPT(config).kinds
    assert (delta.config.attn_gate, delta.config.attn_softcap, delta.config.n_kv_head, delta.config.qk_norm) == (
        "none",
        0.0,
        None,
        "none",
    )
    assert (softmax.config.attn_gate, softmax.config.attn_softcap, softmax.config.n_kv_head) == ("elementwise", 30.0, 1)


def test_a_model_wide_kernel_reaches_the_kinds_whose_function_has_it():
    model = GPT(dataclasses.replace(BASE, layout=("k", "s"), kinds={"k": {"attention": "kda"}, "s": {}},
                                    attn_backend="eager"))  # fmt: skip
    cpu = torch.device("cpu")
    assert [type(model.kernel(cpu, False, True, kind=kind)).__name__ for kind in model.kinds] == [
        "DeltaRecurrent", "SoftmaxEager"]  # fmt: skip


def test_a_switch_never_changes_a_kinds_function():
    model = GPT(KIMI)
    with pytest.raises(ValueError, match="not kinds"):
        model.switch(dataclasses.replace(KIMI, kinds={"kda": {"attention": "gated_deltanet"}, "nope": {}}))


def test_the_maps_of_a_hybrid_show_every_layer_and_the_delta_layers_mix_is_their_output():
    torch.manual_seed(0)
    model = GPT(KIMI).double().eval()
    seen = {}

    def visit(layer):
        return lambda rows, weights: seen.setdefault(layer, []).append(weights)

    idx = torch.randint(0, 50, (1, 20))
    logits = model.attention_weights(idx, visit)
    torch.testing.assert_close(logits, model(idx)[0])
    assert sorted(seen) == [0, 1, 2, 3] and all(torch.cat(w, 2).shape == (1, 2, 20, 20) for w in seen.values())
    assert torch.cat(seen[0], 2).triu(1).abs().max() == 0  # causal


@pytest.mark.parametrize("attention", ["gated_deltanet", "kda"])
def test_under_bf16_autocast_the_state_stays_float32(attention):
    """The rule runs outside autocast (its inputs widened), as fla's kernels keep the state: the cache's state is
    float32 and the logits stay near float32's."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, attention=attention)).eval()
    idx = torch.randint(0, 50, (2, 80))
    cache = model.new_cache(capacity=96, batch=2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = model(idx, cache=cache)
    assert cache.layers[0].state.dtype == torch.float32
    torch.testing.assert_close(mixed.float(), model(idx)[0], atol=0.05, rtol=0.05)


def test_the_flop_count_of_a_recurrent_layer_is_its_states_whatever_the_length():
    """MFU's count: softmax attention's grows with the keys a token sees; the delta rule's and linear attention's
    state products do not (18 H d_k d_v and 12 C D a layer)."""
    counts = {}
    for attention in ("softmax", "linear", "gated_deltanet"):
        with torch.device("meta"):
            model = GPT(dataclasses.replace(BASE, attention=attention))
        counts[attention] = [model.flops_per_token(n) - 6 * model.num_params() for n in (64, 4096)]
    d_k, d_v = 12, 24  # GDN's heads: keys 0.75 x 32 and values 1.5 x 32 over 2 heads
    assert counts["gated_deltanet"] == [2 * 18 * 2 * d_k * d_v] * 2
    assert counts["linear"] == [2 * 12 * 32 * 16] * 2
    assert counts["softmax"] == [2 * 12 * 32 * n for n in (64, 4096)]
