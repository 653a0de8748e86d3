"""CUDA checks: bf16 agreement with the float32 reference, the FlashAttention kernel really runs for
bias-free SDPA, compiled FlexAttention runs ALiBi (forward and backward), and training through the
Trainer as a GPU run does (auto precision, compile, fp16 with its loss scale, FSDP). Skipped without
CUDA; test_gpu_paths.py runs what of this a CPU can."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import pytest
import torch
from conftest import make_text
from torch.nn.attention import SDPBackend, sdpa_kernel

import evaluate as evaluate_script
import sample as sample_script
import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.core.errors import ConfigError
from posgpt.model import ATTENTIONS, GPT, POS_ENCODINGS, SCHEMES, GPTConfig
from posgpt.model.kernels import compiled_flex_attention
from posgpt.model.positions import random_positions
from posgpt.model.terms import Term
from posgpt.training.logs import metrics_file

from helpers import build, relative_error, run_pair, scheme_kinds, straight_and_resumed, tiny_args

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
ODD_LEN = 200  # not a multiple of 16 or of FlexAttention's 128-token blocks
KINDS = scheme_kinds()
NOTHING = next(name for name, s in SCHEMES.items() if not (s.embeds or s.rotates or s.terms or s.uses_positions))
"""The scheme with no position signal at all (NoPE)."""
OTHER_FUNCTIONS = [name for name in ATTENTIONS if name != GPTConfig.attention]


@pytest.fixture
def gpu_config() -> GPTConfig:
    """Head size 64, as in GPT-2, so every fused kernel applies; block 128, so 4x is 512."""
    return GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=256, bias=False)


def fused_kernels(scheme: str, attention: str = GPTConfig.attention) -> list[str]:
    """The fused kernels (those that form no weights: sdpa, flex, chunked) that run `scheme` with `attention`; the
    reference alone (in bf16) where none does (CoPE needs the scores, stick-breaking has only its eager kernel)."""
    kernels = ATTENTIONS[attention].kernels
    runs = []
    for backend, kernel in kernels.items():
        try:
            if not kernel.weights:
                GPTConfig(pos_encoding=scheme, attention=attention, attn_backend=backend)
                runs.append(backend)
        except ConfigError:
            continue
    return runs or [next(name for name, kernel in kernels.items() if kernel.weights)]


@pytest.mark.parametrize(("scheme", "backend"), [(s, b) for s in POS_ENCODINGS for b in fused_kernels(s)])
def test_backend_in_bf16_matches_float32_eager(gpu_config, scheme, backend):
    assert_bf16_matches_eager(gpu_config, scheme, backend)


QUERY_BIAS = next(
    name for name, s in SCHEMES.items() if Term.POSITIONS in s.terms and s.learned_bias and not s.relative
)
"""A learned bias that reads the query's position, not the distance alone (FIRE)."""
SAMPLE = (KINDS["rotation"], KINDS["fixed bias"], QUERY_BIAS)
SAMPLED_FUNCTIONS = [("sigmoid", s, "flex") for s in SAMPLE] + [("differential", s, "flex") for s in SAMPLE] + [
    ("forgetting", s, b) for s in (NOTHING, KINDS["fixed bias"]) for b in fused_kernels(s, "forgetting")] + [
    ("stick_breaking", NOTHING, "eager")]  # fmt: skip
"""A sample chosen by hand (each case a few compiles): a rotation, a fixed bias and a query-dependent learned one on
the flex kernels; FoX and stick-breaking without positions (their papers' setting). A function it lacks runs below
with no positions and with a rotation, on each of its fused kernels."""
SAMPLED_FUNCTIONS += [(f, s, b) for f in OTHER_FUNCTIONS if f not in {a for a, _, _ in SAMPLED_FUNCTIONS}
                      for s in (NOTHING, KINDS["rotation"]) for b in fused_kernels(s, f)]  # fmt: skip


@pytest.mark.parametrize(("attention", "scheme", "backend"), SAMPLED_FUNCTIONS)
def test_the_other_functions_kernels_match_their_eager_reference_in_bf16(gpu_config, attention, scheme, backend):
    assert_bf16_matches_eager(dataclasses.replace(gpu_config, attention=attention), scheme, backend)


def assert_bf16_matches_eager(gpu_config: GPTConfig, scheme: str, backend: str) -> None:
    """`backend` under bf16 autocast against the float32 reference: logits and every gradient."""
    longest = SCHEMES[scheme].longest(dataclasses.replace(gpu_config, pos_encoding=scheme))
    if longest is not None and longest < ODD_LEN:
        gpu_config = dataclasses.replace(gpu_config, block_size=256)  # room for ODD_LEN
    for T, (ref_logits, ref_grads), (logits, grads) in run_pair(
        gpu_config, scheme, backend, CUDA, torch.bfloat16, ODD_LEN
    ):
        assert torch.isfinite(logits).all()
        assert relative_error(logits, ref_logits) < 2e-2, f"logits, T={T}"
        flat = torch.cat([g.flatten() for g in grads.values()])
        ref_flat = torch.cat([ref_grads[name].flatten() for name in grads])
        assert relative_error(flat, ref_flat) < 5e-2, f"all gradients, T={T}"
        for name, grad in grads.items():
            if ref_grads[name].norm() <= 1e-4 * ref_flat.norm():  # 0 but for rounding: FIRE's b2, a per-head
                continue  # constant that softmax cancels (a cosine of rounding noise failed on an H200)
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0)
            assert cosine > 0.99, f"gradient of {name}, T={T}: cosine {cosine:.4f}"


def _forward_backward(model, idx):
    with torch.autocast("cuda", torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    torch.cuda.synchronize()
    return loss


def test_bias_free_sdpa_runs_the_flash_kernel(gpu_config):
    model = build(gpu_config, KINDS["rotation"], "sdpa").to(CUDA)
    idx = torch.randint(0, gpu_config.vocab_size, (4, 512), device=CUDA)
    # with every other SDPA kernel disabled, a call that cannot use FlashAttention raises
    with (
        sdpa_kernel(SDPBackend.FLASH_ATTENTION),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        loss = _forward_backward(model, idx)
    assert torch.isfinite(loss)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention" in ops, sorted(ops)
    # control: a bias's float mask (ALiBi's) is not something the flash kernel accepts, so the same
    # restriction makes it fail; the restriction is real
    biased = build(gpu_config, KINDS["fixed bias"], "sdpa").to(CUDA)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError):
        _forward_backward(biased, idx)


def test_auto_alibi_trains_through_compiled_flex_on_cuda(gpu_config):
    from posgpt.model.kernels import KERNELS
    from posgpt.model.scores import SCORES

    model = GPT(dataclasses.replace(gpu_config, pos_encoding="alibi"))
    needs = model.attention.needs(model.pe, model.kinds[0].mask, SCORES["scaled_dot"], CUDA, needs_grad=True)
    assert model.attention.choose_kernel("auto", needs, CUDA) is KERNELS["flex"]
    model = build(gpu_config, "alibi", "auto").to(CUDA)
    reference = build(gpu_config, "alibi", "eager").to(CUDA)
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, gpu_config.vocab_size, (2, 4 * gpu_config.block_size), device=CUDA)
    loss = _forward_backward(model, idx)
    assert compiled_flex_attention.cache_info().currsize == 1  # the shared compiled kernel ran
    ref_loss = _forward_backward(reference, idx)
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    assert model.wte.weight.grad is not None and torch.isfinite(model.wte.weight.grad).all()


LEARNED_TERMS = [{"pos_encoding": name} for name, scheme in SCHEMES.items()  # every learned bias flex runs
                 if scheme.learned_bias and Term.FROM_SCORES not in scheme.terms] + [
    {"pos_encoding": "fire", "fire_per_layer": True},  # FIRE's option: a bias per layer
    {"pos_encoding": KINDS["rotation"], "attn_window": 64, "attn_sinks": 4},  # a window on a rotation and a bias
    {"pos_encoding": KINDS["fixed bias"], "attn_window": 64},
    {"pos_encoding": KINDS["rotation"], "attn_window": 32, "attn_sinks": 4, "attn_random_blocks": 2,
     "attn_sparse_block": 16}] + [  # each function with learned terms of its own (FoX's gates), alone and with a bias
    extra for f, layer in ATTENTIONS.items() if layer.terms for extra in (
        {"pos_encoding": NOTHING, "attention": f},
        {"pos_encoding": KINDS["fixed bias"], "attention": f, "attn_window": 64, "attn_sinks": 4})]  # fmt: skip


@pytest.mark.parametrize("extra", LEARNED_TERMS)
def test_flex_learned_bias_and_window_masks_match_eager_with_gradients_on_cuda(gpu_config, extra):
    """Only a GPU runs FlexAttention's backward: the gradients of learned biases (T5's table, a captured tensor
    read by the score_mod) and of a function's own terms, and the block masks of windows, against the eager
    reference, in float32."""
    config = dataclasses.replace(gpu_config, **extra)
    model = GPT(dataclasses.replace(config, attn_backend="flex")).to(CUDA)
    reference = GPT(dataclasses.replace(config, attn_backend="eager")).to(CUDA)
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 2 * config.block_size + 13), device=CUDA)
    for m in (model, reference):
        _, loss = m(idx, idx)
        loss.backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-4, rtol=1e-3, msg=name)
    if model.pe.learned_bias:  # every parameter of the scheme gets a gradient through flex (T5's table, Kerple's
        whole = torch.cat([r.grad.flatten() for r in reference.pe.parameters()]).norm()  # r1 and r2, ...)
        assert whole > 0
        for (name, p), r in zip(model.pe.named_parameters(), reference.pe.parameters(), strict=True):
            cancelled = r.grad.norm() <= 1e-4 * whole  # 0 but for rounding: FIRE's b2, which softmax cancels
            assert cancelled or p.grad.abs().sum() > 0, name
    if ATTENTIONS[config.attention].terms:  # the layer's own terms (FoX's gate sums, captured by the score_mod)
        assert all(p.grad.abs().sum() > 0 for p in model.blocks[0].attn.parameters())  # carry gradients


@pytest.mark.parametrize("scheme", KINDS.values())
def test_randomized_positions_through_flex_match_eager_with_gradients_on_cuda(gpu_config, scheme):
    """Each row's own positions (B, T) reach FlexAttention's score_mod (ids[b, q] - ids[b, kv]) and
    RoPE's tables as they reach the eager reference, gradients included."""
    config = dataclasses.replace(gpu_config, pos_encoding=scheme)
    model = GPT(dataclasses.replace(config, attn_backend="flex")).to(CUDA)
    reference = GPT(dataclasses.replace(config, attn_backend="eager")).to(CUDA)
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, ODD_LEN), device=CUDA)
    positions = random_positions(2, ODD_LEN, 4 * config.block_size, torch.Generator().manual_seed(0), CUDA)
    for m in (model, reference):
        m.pe.reserve(4 * config.block_size)
        _, loss = m(idx, idx, positions=positions)
        loss.backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-4, rtol=1e-3, msg=name)


def _record_step_norms(monkeypatch) -> list[float]:
    """Patch AdamW.step to record the global gradient norm the optimizer steps with: after Lightning's
    closure (forward, backward, clipping) under bf16, at entry under fp16 (GradScaler.step calls step
    after the closure and the clipping already ran)."""
    norms: list[float] = []
    real_step = torch.optim.AdamW.step

    def norm(optimizer) -> float:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])).item()

    def recording_step(self, closure=None):
        if closure is None:
            norms.append(norm(self))
            return real_step(self)

        def wrapped():
            loss = closure()
            norms.append(norm(self))
            return loss

        return real_step(self, wrapped)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    return norms


def _gpu_run(tmp_path, text_file, *extra: str) -> list[str]:

    return tiny_args(tmp_path, text_file, "--train.max_steps", "12", "--train.eval_interval", "12", *extra)


def test_default_gpu_run_trains_with_compile_bf16_fused_adamw_clipping_and_mfu(tmp_path, text_file, monkeypatch):
    """The first optimizer step of every default GPU run failed (bf16-mixed + fused AdamW + clipping);
    test_gpu_paths.py reproduces it on the CPU, this runs the real thing: auto precision, compile,
    pinned memory and the MFU logged against the device's peak."""
    norms = _record_step_norms(monkeypatch)
    cli.run(train_script.COMMAND, _gpu_run(tmp_path, text_file, "--train.compile", "true", "--optim.grad_clip", "0.05"))
    assert len(norms) == 12 and norms == pytest.approx([0.05] * 12, rel=1e-2)
    with open(metrics_file(tmp_path / "runs" / "tiny")) as f:
        mfu = [float(row["perf/mfu"]) for row in csv.DictReader(f) if row.get("perf/mfu")]
    assert mfu and all(0 < m < 1 for m in mfu)


def test_fp16_mixed_unscales_before_clipping_through_the_trainer(tmp_path, text_file, monkeypatch):
    """GradScaler with the fused AdamW: only CUDA runs 16-mixed (Lightning turns it into bf16 on a CPU)."""

    norms = _record_step_norms(monkeypatch)
    cli.run(
        train_script.COMMAND,
        _gpu_run(tmp_path, text_file, "--train.precision", "16-mixed", "--optim.grad_clip", "0.05"),
    )
    finite = [n for n in norms if math.isfinite(n)]  # steps the scaler skips have inf gradients
    assert finite and finite == pytest.approx([0.05] * len(finite), rel=1e-2)


def test_fsdp_on_one_gpu_clips_through_the_sharded_module(tmp_path, text_file):
    """Lightning runs FSDP only on GPUs; its own clipping refuses FSDP, ours calls the root module's
    clip_grad_norm_."""
    cli.run(train_script.COMMAND, _gpu_run(tmp_path, text_file, "--train.strategy", "fsdp", "--train.devices", "1"))
    assert read_checkpoint(tmp_path / "runs" / "tiny" / "last.ckpt")["global_step"] == 12


def test_fsdp_at_world_size_one_resumes_as_an_uninterrupted_run(tmp_path, text_file):
    """FSDP's full state dicts restore weights, optimizer moments and the data stream: a run
    stopped halfway and resumed ends where the uninterrupted one does (float32: no bf16 rounding
    between the two orders of operations; the tolerance allows for non-deterministic kernels)."""
    common = ["--train.strategy", "fsdp", "--train.devices", "1", "--train.precision", "32-true",
              "--train.eval_interval", "5", "--train.ckpt_interval", "5", "--optim.decay_steps", "10"]  # fmt: skip
    a, b = straight_and_resumed(tmp_path, text_file, 10, *common)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fp8_trains_through_the_trainer_where_the_gpu_has_fp8(tmp_path, text_file):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores on this GPU")
    pytest.importorskip("torchao.float8")
    argv = _gpu_run(tmp_path, text_file, "--train.fp8", "true", "--train.compile", "true",
                    "--model.n_embd", "64", "--model.n_head", "4")  # fmt: skip
    cli.run(train_script.COMMAND, argv)
    ckpt = read_checkpoint(tmp_path / "runs" / "tiny" / "last.ckpt")
    assert ckpt["global_step"] == 12 and all(torch.isfinite(t).all() for t in ckpt["state_dict"].values())


@pytest.mark.parametrize("scheme", ["alibi", "kerple"])  # a sample (each a compile): a fixed bias, a learned one
def test_activation_checkpointing_through_compiled_flex_gives_the_plain_gradients(gpu_config, scheme):
    """Recomputed blocks around FlexAttention under torch.compile (the CUDA default for bias schemes
    with --train.activation_checkpointing) against the same model without recomputation."""
    config = dataclasses.replace(gpu_config, pos_encoding=scheme)
    plain = GPT(config).to(CUDA)
    recomputed = GPT(config).to(CUDA)
    recomputed.load_state_dict(plain.state_dict())
    recomputed.activation_checkpointing = True
    idx = torch.randint(0, config.vocab_size, (2, config.block_size + 1), device=CUDA)
    for model in (plain, recomputed):
        model.compile()
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
    for (name, p), r in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(r.grad, p.grad, atol=1e-3, rtol=1e-2, msg=name)


LONG = (
    [{"pos_encoding": s} for s in POS_ENCODINGS]
    + [
        {"pos_encoding": KINDS["rotation"], "attn_window": 1024, "attn_sinks": 4},
        {"pos_encoding": KINDS["rotation"], "attn_window": 1024, "attn_sinks": 4, "attn_random_blocks": 3},
    ]
    + [{"pos_encoding": NOTHING, "attention": f} for f in OTHER_FUNCTIONS]
)  # each other function: its own cost


@pytest.mark.slow
@pytest.mark.parametrize("fields", LONG, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_a_compiled_bf16_training_step_at_16k_tokens_runs_for_every_scheme(fields):
    """Issue 22: T=16384 did not finish within 200 s for any scheme. One compiled step of a small
    model at 16384 tokens (forward, backward) must now finish, with finite gradients."""
    config = GPTConfig(vocab_size=256, block_size=16384, n_layer=2, n_head=4, n_embd=256, bias=False, **fields)
    torch.manual_seed(0)
    model = GPT(config).to(CUDA)
    model.compile()
    idx = torch.randint(0, 256, (1, 16385), device=CUDA)
    for _ in range(2):  # the second step reuses the compiled graphs and the block mask
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.fixture(scope="module")
def cpu_checkpoints(tmp_path_factory) -> dict[str, object]:
    """Tiny rope and alibi checkpoints trained on the CPU, to be run on the GPU."""

    tmp = tmp_path_factory.mktemp("gpu-eval")
    text = tmp / "corpus.txt"
    text.write_text(make_text(1500))
    ckpts: dict[str, object] = {"text": text}
    for scheme in ("rope", "alibi"):
        argv = tiny_args(tmp / scheme, text, "--model.pos_encoding", scheme, "--train.max_steps", "20",
                         "--train.eval_interval", "20", "--train.accelerator", "cpu")  # fmt: skip
        cli.run(train_script.COMMAND, argv)
        ckpts[scheme] = tmp / scheme / "runs" / "tiny" / "last.ckpt"
    return ckpts


def test_evaluation_on_cuda_runs_bf16_autocast_and_flex_and_matches_the_cpu(cpu_checkpoints, tmp_path):
    """evaluate.py's GPU branch: bf16 autocast by default, FlexAttention for ALiBi, the device's name."""
    common = ["--ckpt", str(cpu_checkpoints["rope"]), str(cpu_checkpoints["alibi"]), "--eval.lengths", "[32,128]",
              "--eval.token_budget", "512", "--eval.progress", "false"]  # fmt: skip
    docs = {}
    for device in ("cpu", "cuda"):
        cli.run(evaluate_script.COMMAND, [*common, "--eval.device", device, "--out", str(tmp_path / device)])
        docs[device] = json.loads((tmp_path / device / "results.json").read_text())
    assert docs["cuda"]["dtype"] == "bfloat16" and "NVIDIA" in docs["cuda"]["device"]
    for run, ref in zip(docs["cuda"]["runs"], docs["cpu"]["runs"], strict=True):
        for row, ref_row in zip(run["results"], ref["results"], strict=True):
            assert row["loss"] == pytest.approx(ref_row["loss"], rel=2e-2)


@pytest.mark.parametrize("compile_flag", [[], ["--compile", "true"]])
def test_sampling_on_cuda_in_bf16_eager_and_compiled(cpu_checkpoints, capsys, compile_flag):
    """sample.py's GPU branch: bf16 weights by default, a CUDA generator, and --compile."""
    cli.run(sample_script.COMMAND, ["--ckpt", str(cpu_checkpoints["rope"]), "--prompt", "The king",
                                    "--max_new_tokens", "40", "--temperature", "0", *compile_flag])  # fmt: skip
    captured = capsys.readouterr()
    assert captured.out.startswith("The king") and len(captured.out.rstrip("\n")) == len("The king") + 40
    assert "cuda" in captured.err and "bfloat16" in captured.err


def test_resume_on_cuda_restores_the_cuda_random_stream(tmp_path, text_file):
    """Dropout on a GPU draws from the CUDA generator, which checkpoints save and a resume restores:
    a branch a CPU never takes. Tolerances allow for non-deterministic GPU kernels, not for other
    dropout masks (which move the weights by orders of magnitude more)."""
    common = ["--model.dropout", "0.1", "--train.eval_interval", "5", "--train.ckpt_interval", "5",
              "--optim.decay_steps", "10", "--train.precision", "32-true"]  # fmt: skip
    a, b = straight_and_resumed(tmp_path, text_file, 10, *common)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


DECODING = (
    [{"pos_encoding": s} for s in POS_ENCODINGS]
    + [{"attn_window": 32, "attn_sinks": 4}]
    + [
        {"pos_encoding": NOTHING, "attention": f}
        for f in OTHER_FUNCTIONS  # each other function's cache
    ]
)


@pytest.mark.parametrize("fields", DECODING)
def test_compiled_decoding_runs_as_cuda_graphs_and_gives_eager_tokens(gpu_config, fields):
    """compile_for_decoding on CUDA: reduce-overhead (CUDA graphs over the static cache) with no graph
    skipped for mutated inputs, and the greedy tokens of eager decoding, for a padded batch. In float64:
    random weights leave top-2 margins that float32's other summation orders (and TF32) can flip (the
    H200 run of 2026-11-26 failed five schemes of eight in float32 with no message kept)."""
    from torch._dynamo.utils import counters

    from posgpt.model.generation import compile_for_decoding, pad_prompts

    model = GPT(dataclasses.replace(gpu_config, **fields)).to(CUDA, torch.float64).eval()
    idx, lengths = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]], CUDA)
    eager = torch.cat(list(model_stream(model, idx, lengths)), dim=1)
    torch._dynamo.reset()
    counters.clear()
    compile_for_decoding(model)
    compiled = torch.cat(list(model_stream(model, idx, lengths)), dim=1)
    differ = (compiled != eager).nonzero().tolist()
    assert not differ, f"compiled tokens differ from eager's first at (row, step) {differ[0]} of {tuple(eager.shape)}"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch._dynamo.reset()


def model_stream(model: GPT, idx: torch.Tensor, lengths: torch.Tensor):
    from posgpt.model.generation import stream

    return stream(model, idx, 100, temperature=0, lengths=lengths)
