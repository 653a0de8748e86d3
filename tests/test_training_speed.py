"""The training-speed switches of issue 22, each against the plain path: activation checkpointing
(same loss and gradients, dropout included), the FP8 flag (refused in one line where the hardware
has no FP8; on a CPU with torchao installed, the conversion itself), the compile mode, and the one
line that says when attention dropout moves a scheme off FlexAttention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import train as train_script
from posgpt.core.device import DeviceError
from posgpt.model import GPT, GPTConfig
from posgpt.training import hardware
from posgpt.training.run import dropout_fallback

from helpers import cli_error, tiny_args

SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)


def _loss_and_grads(model: GPT, idx: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # dropout's masks
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize(
    "fields",
    [
        {"pos_encoding": "rope"},
        {"pos_encoding": "alibi", "attn_window": 8, "attn_sinks": 2},
        {"pos_encoding": "t5", "dropout": 0.2},  # learned bias; masks drawn again in the recomputation
        {"pos_encoding": "learned", "dropout": 0.1, "attention": "linear"},
    ],
    ids=["rope", "alibi-window-sinks", "t5-dropout", "learned-linear-dropout"],
)
def test_activation_checkpointing_gives_the_same_loss_and_gradients(fields):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(SMALL, **fields)).train()
    idx = torch.randint(0, 64, (3, 25))
    plain_loss, plain = _loss_and_grads(model, idx)
    model.activation_checkpointing = True
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss, grads = _loss_and_grads(model, idx)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    model.activation_checkpointing = False
    everything = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: everything.append(t.numel()) or t, lambda t: t):
        _loss_and_grads(model, idx)
    assert sum(saved) < 0.5 * sum(everything)  # what the backward pass keeps: the blocks' inputs, not all


def test_activation_checkpointing_is_off_outside_training():
    model = GPT(SMALL).eval()
    model.activation_checkpointing = True
    idx = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        logits, _ = model(idx)
    assert logits.shape == (2, 12, 64)
    assert model.generate(idx[:, :4], 3).shape == (2, 7)  # decoding with a cache never recomputes


def test_dropout_fallback_is_said_where_it_moves_a_scheme_off_flex():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # kernels are chosen by device type alone
    alibi = GPT(dataclasses.replace(SMALL, pos_encoding="alibi", dropout=0.1))
    line = dropout_fallback(alibi, cuda)
    assert line is not None and "pos_encoding=alibi" in line and "sdpa" in line and "flex" in line
    assert "--model.dropout 0" in line and "\n" not in line
    window = GPT(dataclasses.replace(SMALL, pos_encoding="rope", attn_window=8, dropout=0.1))
    assert "attn_window=8" in dropout_fallback(window, cuda)
    assert dropout_fallback(alibi, cpu) is None  # SDPA either way
    assert dropout_fallback(GPT(dataclasses.replace(SMALL, pos_encoding="rope", dropout=0.1)), cuda) is None
    assert dropout_fallback(GPT(dataclasses.replace(SMALL, pos_encoding="alibi")), cuda) is None
    flex = GPT(dataclasses.replace(SMALL, pos_encoding="alibi", attn_backend="flex"))
    assert dropout_fallback(flex, cuda) is None  # a named kernel: nothing falls back, nothing to say


def test_fp8_without_fp8_hardware_is_one_line_before_any_work(tmp_path, text_file, capsys):
    argv = tiny_args(tmp_path, text_file, "--train.fp8", "true", "--train.accelerator", "cpu")
    line = cli_error(capsys, train_script.COMMAND, argv)
    assert "--train.fp8 true needs an NVIDIA GPU with FP8 tensor cores" in line and "--train.fp8 false" in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "prepared").exists()


def test_fp8_on_a_gpu_without_fp8_names_its_capability(monkeypatch):
    monkeypatch.setattr(hardware, "uses_cuda", lambda accelerator: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(DeviceError, match=r"A100-SXM4-80GB has 8\.0"):
        hardware.check_fp8("gpu", "bf16-mixed")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(DeviceError, match="Use --train.precision bf16-mixed"):
        hardware.check_fp8("gpu", "32-true")


def test_fp8_converts_the_blocks_linear_layers_and_trains_close_to_bf16(monkeypatch):
    monkeypatch.setenv("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # its CUDA extensions: none on a CPU
    pytest.importorskip("torchao.float8")  # torch's CPU _scaled_mm runs its FP8 matmuls here
    torch.manual_seed(0)
    plain = GPT(SMALL)
    converted = GPT(SMALL)
    converted.load_state_dict(plain.state_dict())
    keys = list(converted.state_dict())
    assert hardware.convert_to_fp8(converted) == 4 * SMALL.n_layer  # qkv, proj, fc, proj per block
    assert list(converted.state_dict()) == keys  # checkpoints keep their layout
    assert type(converted.lm_head).__name__ == "Linear"  # the tied output layer stays bf16
    assert type(converted.blocks[0].mlp.fc).__name__ == "Float8Linear"
    idx = torch.randint(0, 64, (4, 33))
    losses = []
    for model in (plain, converted):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 0.02 * losses[0]
    for (name, p), q in zip(plain.named_parameters(), converted.parameters(), strict=True):
        error = (q.grad - p.grad).norm() / p.grad.norm()
        assert error < 0.15, (name, error)  # FP8's rounding: ~5% on a layer (e4m3: 3 mantissa bits)


def test_train_py_compiles_in_the_mode_asked_and_recomputes_blocks_when_asked(tmp_path, text_file, monkeypatch):
    import posgpt.model.gpt as gpt_module
    from posgpt.core import cli

    modes, recomputed = [], []
    monkeypatch.setattr(GPT, "compile", lambda self, mode=None: modes.append(mode))  # the mode, not minutes of Inductor
    real = gpt_module.checkpoint
    monkeypatch.setattr(gpt_module, "checkpoint", lambda *a, **k: recomputed.append(1) or real(*a, **k))
    argv = tiny_args(tmp_path, text_file, "--train.max_steps", "2", "--train.compile", "true",
                     "--train.compile_mode", "max-autotune-no-cudagraphs",
                     "--train.activation_checkpointing", "true")  # fmt: skip
    cli.run(train_script.COMMAND, argv)
    assert modes == ["max-autotune-no-cudagraphs"]
    assert len(recomputed) >= 2 * 2  # every block of every training step (validation runs without)
