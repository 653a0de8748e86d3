"""The LightningModule around the GPT (`training/module.py`): the LR schedule, AdamW's parameter
groups, clipping under fp16, and randomized positions drawn per micro-batch."""

from __future__ import annotations

import types

import pytest
import torch

from posgpt.model import GPTConfig
from posgpt.training.config import RunConfig, TrainConfig, lr_factor
from posgpt.training.module import GPTModule, clip_grad_norm


def _module(scheme: str = "rope", **train: object) -> GPTModule:
    model = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, pos_encoding=scheme)
    config = RunConfig(model=model, train=TrainConfig(**train))
    return GPTModule(config, tokenizer={"kind": "char"}, data={})


def test_the_schedule_warms_up_linearly_decays_by_cosine_then_stays_flat():
    base, low, warmup, decay = 1e-3, 1e-4, 10, 110
    factors = [lr_factor(step, base, low, warmup, decay) for step in range(130)]
    assert factors[:warmup] == pytest.approx([(s + 1) / (warmup + 1) for s in range(warmup)])
    assert factors[warmup] == pytest.approx(1.0)
    middle = warmup + (decay - warmup) // 2  # half way through the cosine: half way from base to low
    assert factors[middle] == pytest.approx((low + 0.5 * (base - low)) / base)
    assert factors[decay] == pytest.approx(low / base) and set(factors[decay + 1 :]) == {low / base}
    assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1 :], strict=False))


def test_weight_decay_goes_to_matrices_only_and_the_cpu_step_is_fused():
    module = _module()  # on the CPU, where the step is fused too
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == module.config.optim.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    named = sum(p.numel() for p in module.model.parameters())
    assert sum(p.numel() for group in (decay, no_decay) for p in group["params"]) == named
    assert optimizer.defaults["fused"]


def test_random_positions_are_drawn_per_micro_batch_and_never_for_a_scheme_without_positions():
    module = _module(random_positions=64, grad_accum=2, seed=3)
    x = torch.zeros(4, 16, dtype=torch.long)
    first, again, second = (module._random_positions(x, i) for i in (0, 0, 1))
    assert first.shape == (4, 16) and torch.equal(first, again) and not torch.equal(first, second)
    assert (first.diff(dim=-1) > 0).all() and first.max() < 64
    assert _module("none", random_positions=64)._random_positions(x, 0) is None  # NoPE reads no positions


def test_fp16_gradients_are_unscaled_before_they_are_clipped():
    """Under 16-mixed Lightning leaves unscaling to a fused optimizer's step; clipping a norm of scaled
    gradients would be wrong. Checked against float32 with the same clipping, on CPU tensors."""
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    trainer = types.SimpleNamespace(
        precision_plugin=types.SimpleNamespace(scaler=scaler), strategy=types.SimpleNamespace(model=model)
    )
    x = torch.randn(4, 8)
    scaler.scale(model(x).pow(2).sum()).backward()
    norm = clip_grad_norm(trainer, model, optimizer, max_norm=0.5)
    scaler.step(optimizer)
    scaler.update()
    reference(x).pow(2).sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_optimizer.step()
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6) and ref_norm > 0.5
    torch.testing.assert_close(model.weight, reference.weight)
