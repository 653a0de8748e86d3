"""CUDA runs of the whole: training through the Trainer as a GPU run does (auto precision, compile, fp16 with its
loss scale, FSDP, fp8, recomputed blocks), a compiled step at 16k tokens for every scheme and function, evaluation,
sampling and resume on CUDA, compiled decoding as CUDA graphs. Skipped without CUDA; test_gpu.py holds the kernels'
numerics, test_gpu_paths.py runs what of this a CPU can."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import pytest
import torch
from conftest import make_text
from test_gpu import CUDA, KINDS, NOTHING, OTHER_FUNCTIONS

import evaluate as evaluate_script
import sample as sample_script
import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.model import GPT, POS_ENCODINGS, GPTConfig
from posgpt.training.logs import metrics_file

from helpers import straight_and_resumed, tiny_args

pytestmark = pytest.mark.gpu


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


def test_fsdp2_on_one_gpu_clips_through_the_sharded_module(tmp_path, text_file):
    """FSDP2 on NCCL, its blocks compiled one by one: the clipping takes the norm of DTensor gradients."""
    argv = _gpu_run(tmp_path, text_file, "--train.strategy", "fsdp2", "--train.devices", "1", "--train.compile", "true")
    cli.run(train_script.COMMAND, argv)
    assert read_checkpoint(tmp_path / "runs" / "tiny" / "last.ckpt")["global_step"] == 12


def test_fsdp_at_world_size_one_resumes_as_an_uninterrupted_run(tmp_path, text_file):
    """FSDP2's full state dicts (`fsdp`: its alias) restore weights, optimizer moments and the data stream: a run
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
