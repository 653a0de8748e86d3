"""What a GPU run exercises, run on the CPU: bf16-mixed training through the Trainer (compiled) with the fused
optimizer, clipping and accumulation; the shipped GPU configs; the precision `auto` picks; and the CUDA-only
branches (MFU peaks, synchronisation, pinned memory), driven with a stand-in CUDA device. What can only
fail on a GPU is in test_gpu.py."""

from __future__ import annotations

import csv
import types
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import train as train_script
from posgpt.core import cli
from posgpt.core.checkpoint import read_checkpoint
from posgpt.data.dataset import load_prepared
from posgpt.data.prepare import prepare
from posgpt.training import hardware
from posgpt.training.callbacks import MetricsWriter
from posgpt.training.datamodule import TokenDataModule
from posgpt.training.logs import metrics_file

from helpers import straight_and_resumed

ROOT = Path(__file__).resolve().parents[1]


def _global_norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def test_resume_under_bf16_is_exact(tmp_path, text_file):
    """Weights, optimizer, LR schedule, data position and the random streams (dropout on; the positions
    `--train.random_positions` draws from (seed, step)) restored: the same weights to the bit as an uninterrupted
    run (the one resume test of train.py; signals and studies have theirs)."""
    common = ["--train.precision", "bf16-mixed", "--model.dropout", "0.1", "--train.eval_interval", "5",
              "--train.ckpt_interval", "5", "--optim.decay_steps", "10", "--train.random_positions", "96",
              "--train.logger", "none"]  # fmt: skip
    a, b = straight_and_resumed(tmp_path, text_file, 10, *common)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def _shrunk(tmp_path: Path, text_file: Path, config: str, *extra: str) -> list[str]:
    """configs/`config` with a tiny model and two steps (the file first: later options override it)."""
    return [
        "--config", str(ROOT / "configs" / config),
        "--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
        "--train.batch_size", "4", "--train.max_steps", "2", "--train.eval_interval", "2",
        "--train.eval_tokens", "256", "--train.precision", "bf16-mixed", "--train.progress_bar", "false",
        "--train.logger", "csv", "--train.run_name", "gpu-config",
        "--data.input", str(text_file), "--data.prepared_root", str(tmp_path / "prepared"),
        "--train.out_dir", str(tmp_path / "runs"), *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name", ["shakespeare_char.yaml", "shakespeare_char_gpu.yaml", "gpt2_124m.yaml", "nanogpt_cpu.yaml"]
)
def test_every_shipped_training_config_is_a_valid_run(name, text_file):
    """Parsed and validated as train.py reads it, with the corpus it asks for (one trains below, compiled, bf16)."""
    config = cli.parse(train_script.COMMAND, ["--config", str(ROOT / "configs" / name), "--data.input", str(text_file)])
    assert config.optim.grad_clip == 1.0 and config.model.block_size >= 64


@pytest.mark.slow
def test_the_gpu_recipe_compiles_and_trains_in_bf16_on_cpu_clipping_before_every_fused_step(
    tmp_path, text_file, capsys, monkeypatch
):
    """torch.compile with bf16 autocast, dropout, clipping and a validation pass, as
    configs/shakespeare_char_gpu.yaml runs it on a GPU; the sample at the end runs eagerly. The default GPU run
    (bf16-mixed, fused AdamW, clipping) used to stop at its first step: here with accumulation, every optimizer
    step is fused and follows the clipping. The backend is Inductor's graph pipeline without its code generation
    (aot_eager_decomp_partition: Dynamo, AOTAutograd, Inductor's decompositions and partitioner): its CPU
    code (half a minute of C++ compiles for three graphs on a fresh machine) is not what a GPU runs: test_gpu.py
    runs the real recipe on a GPU, and test_cache.py runs Inductor's CPU code in compiled decoding."""
    graphs_with_grad: list[bool] = []  # per graph compiled: traced for training (True) or for validation
    real_compile = torch.nn.Module.compile

    def without_codegen(module: torch.nn.Module, mode: str) -> None:
        def counted(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]):
            graphs_with_grad.append(torch.is_grad_enabled())
            return lookup_backend("aot_eager_decomp_partition")(graph, inputs)

        real_compile(module, backend=counted, mode=mode)

    monkeypatch.setattr(torch.nn.Module, "compile", without_codegen)
    norms_at_step: list[float] = []
    real_step = torch.optim.AdamW.step

    def recording_step(self, closure=None):
        def after_backward_and_clipping():
            loss = closure()  # Lightning's closure: forward, backward, then the clipping hook
            norms_at_step.append(_global_norm(self))
            return loss

        assert self.defaults["fused"]
        return real_step(self, after_backward_and_clipping)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    args = _shrunk(tmp_path, text_file, "shakespeare_char_gpu.yaml", "--train.sample_tokens", "20",
                   "--optim.grad_clip", "0.05", "--train.grad_accum", "2", "--train.max_steps", "6",
                   "--train.log_interval", "2", "--train.eval_interval", "6")  # fmt: skip
    cli.run(train_script.COMMAND, args)
    run_dir = tmp_path / "runs" / "gpu-config"
    ckpt = read_checkpoint(run_dir / "last.ckpt")
    config = ckpt["hyper_parameters"]["config"]
    assert ckpt["global_step"] == 6 and config["train"]["compile"] and config["model"]["dropout"] == 0.2
    assert graphs_with_grad == [True, False]  # one graph trained, one validated: compiled, without graph breaks
    assert len(norms_at_step) == 6  # one clipped step per two micro-batches
    assert norms_at_step == pytest.approx([0.05] * 6, rel=1e-3)
    with open(metrics_file(run_dir)) as f:
        logged = [float(row["train/grad_norm"]) for row in csv.DictReader(f) if row.get("train/grad_norm")]
    assert len(logged) == 3 and all(norm > 0.05 for norm in logged)  # the norm before clipping
    out = capsys.readouterr().out
    assert "--- sample ---" in out


def _capabilities(monkeypatch, **caps: bool) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)


def test_auto_precision_by_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert hardware.resolve_precision("auto", "auto") == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # e.g. a V100 or T4
    assert hardware.resolve_precision("auto", "gpu") == "16-mixed"
    assert hardware.resolve_precision("32-true", "gpu") == "32-true"  # explicit settings stay
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _capabilities(monkeypatch, avx512_bf16=True)
    assert hardware.resolve_precision("auto", "auto") == "bf16-mixed"
    _capabilities(monkeypatch, amx_bf16=True)
    assert hardware.resolve_precision("auto", "cpu") == "bf16-mixed"
    _capabilities(monkeypatch, avx2=True)  # no bf16 instructions: bf16 would be emulated
    assert hardware.resolve_precision("auto", "cpu") == "32-true"
    assert hardware.resolve_precision("auto", "mps") == "32-true"


class _StandInCuda:
    """A CUDA device as far as the CUDA-only branches can tell: its name, and a synchronize that counts."""

    def __init__(self, monkeypatch, name: str = "NVIDIA H100 80GB HBM3") -> None:
        self.syncs = 0
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "synchronize", self._sync)

    def _sync(self, device=None) -> None:
        self.syncs += 1


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4e12),
        ("NVIDIA H100 80GB HBM3", "32-true", 494.7e12),  # TF32
        ("NVIDIA H100 PCIe", "16-mixed", 756.0e12),
        ("NVIDIA H200", "bf16-mixed", 989.4e12),  # Lightning's table has no plain H200
        ("NVIDIA H200 NVL", "bf16-mixed", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312e12),
        ("Tesla T4", "16-mixed", 65e12),  # from Lightning's table
    ],
)
def test_mfu_peaks_are_dense_bf16_figures(monkeypatch, name, precision, peak):
    _StandInCuda(monkeypatch, name)
    assert hardware.peak_flops(torch.device("cuda"), precision) == pytest.approx(peak)
    assert hardware.peak_flops(torch.device("cpu"), precision) is None


def test_speed_reading_on_cuda_syncs_only_when_it_measures_and_logs_mfu(monkeypatch):
    cuda = _StandInCuda(monkeypatch)
    written: list[dict[str, float]] = []  # what MetricsWriter hands the loggers
    logger = types.SimpleNamespace(log_metrics=lambda metrics, step: written.append(metrics), save=lambda: None)
    module = types.SimpleNamespace(tokens_seen=0, pending={}, logged={})
    trainer = types.SimpleNamespace(
        strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)),
        precision="bf16-mixed",
        world_size=2,
        accumulate_grad_batches=2,
        loggers=[logger],
        global_step=1,
        current_epoch=0,
    )
    monitor = MetricsWriter(flops_per_token=6_000_000, log_every=5)
    monitor.setup(trainer, module, "fit")
    for batch_idx in range(2 * (1 + 10)):  # the first step starts the clock; then two measurements of 5 steps
        module.tokens_seen += 512
        monitor.on_train_batch_end(trainer, module, None, None, batch_idx)  # acts on every second micro-batch
    assert cuda.syncs == 3  # the start and each measurement, never every step
    assert len(written) == 2
    for metrics in written:  # MFU per device
        assert metrics["perf/mfu"] == pytest.approx(metrics["perf/tokens_per_s"] / 2 * 6_000_000 / 989.4e12)


def test_batches_are_pinned_for_cuda_only(tmp_path, text_file):
    prepare(str(text_file), str(tmp_path / "data"))
    datamodule = TokenDataModule(load_prepared(tmp_path / "data"), block_size=16, batch_size=2, seed=0)
    for device, pinned in ((torch.device("cpu"), False), (torch.device("cuda", 0), True)):
        datamodule.trainer = types.SimpleNamespace(
            strategy=types.SimpleNamespace(root_device=device), global_rank=0, global_step=0, accumulate_grad_batches=1
        )
        assert datamodule.train_dataloader().pin_memory is pinned
        assert datamodule.val_dataloader().pin_memory is pinned


def test_a_masked_sdpa_call_that_needs_a_gradient_on_cuda_stays_off_cudnn():
    """pytorch#196678 (tests/test_gpu.py has its repro shape): where q is on CUDA and needs a gradient, a masked SDPA
    call runs with cuDNN's backend off and the others on; elsewhere nothing changes (a stand-in for CUDA's q)."""
    from posgpt.model.kernels.sdpa import off_cudnn

    with off_cudnn(types.SimpleNamespace(is_cuda=True, requires_grad=True)):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    for q in (types.SimpleNamespace(is_cuda=True, requires_grad=False), torch.ones(1, requires_grad=True)):
        with off_cudnn(q):
            assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_bias_reaches_sdpa_in_the_queries_dtype(monkeypatch):
    """pytorch PR #191612: cuDNN read an fp32 mask as bf16 bits; posgpt hands SDPA the bias in q's dtype."""
    from posgpt.model.kernels import sdpa

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        sdpa.F, "scaled_dot_product_attention", lambda *a, **k: seen.append(k["attn_mask"]) or real(*a, **k)
    )
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    sdpa.sdpa_attention(q, q, q, bias=torch.zeros(8, 8))
    assert seen[0].dtype == torch.float64
