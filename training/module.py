"""The LightningModule around `GPT`: loss, AdamW parameter groups, the LR schedule, and logging."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from posgpt.core.errors import ConfigError
from posgpt.core.threads import revisit
from posgpt.data.dataset import Batch
from posgpt.model import GPT
from posgpt.model.positions import random_positions
from posgpt.training.config import OptimConfig, RunConfig, lr_factor
from posgpt.training.distributed import shard

log = logging.getLogger(__name__)


def parameter_groups(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """`model`'s trainable parameters: the matrices (weight decay) and the rest (none), AdamW's two groups."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trainable if p.dim() >= 2], [p for p in trainable if p.dim() < 2]


def adamw(model: torch.nn.Module, o: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters, weight decay on matrices only, fused (on a CPU too: ~3 ms a step)."""
    decay, no_decay = parameter_groups(model)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        fused=device.type in ("cuda", "cpu"),
    )


class GPTModule(L.LightningModule):
    """Trains a GPT. Every checkpoint's hyper-parameters hold the resolved `config`, the tokenizer and the training
    data's provenance (`data`), as plain dicts: a checkpoint alone rebuilds model and tokenizer."""

    def __init__(self, config: RunConfig, tokenizer: dict[str, Any], data: dict[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters({"config": dataclasses.asdict(config), "tokenizer": tokenizer, "data": data})
        self.config = config
        self.model = GPT(config.model)
        # kept in checkpoints: training tokens over every device, wall time over every launch, the switch's step
        self.tokens_seen, self.train_seconds = 0, 0.0
        self.switched_at: int | None = None
        self._launch_started: tuple[float, float] | None = None  # (monotonic clock, train_seconds) at the start
        self._val_sum: torch.Tensor | None = None
        self.nonfinite: torch.Tensor | None = None  # any loss NaN or inf, on the device (LastCheckpoint reads it)
        self.pending: dict[str, torch.Tensor | float] = {}
        """This logging step's metrics, tensors left on the device until `MetricsWriter` reads them all at once."""
        self.logged: dict[str, float] = {}
        """The metrics of the last logging step, as floats (the progress lines and bar read them, with no sync)."""

    def configure_model(self) -> None:
        """Under FSDP2 (Lightning sets a device mesh) shard the model, each block compiled after it is sharded
        (`train.compile`); else compile it whole. In place (state_dict keys keep their names), once."""
        t = self.config.train
        mode = t.compile_mode if t.compile else None
        if self.device_mesh is not None and not isinstance(self.model, FSDPModule):
            shard(self.model, self.device_mesh["data_parallel"], mode)
        elif self.device_mesh is None and mode is not None:
            self.model.compile(mode=mode)

    def on_train_start(self) -> None:
        self._launch_started = (time.monotonic(), self.train_seconds)
        # refuse, before the first step, a switch that replaces parameters on several devices
        several = self.config.train.switch_model and self.switched_at is None and self.trainer.world_size > 1
        if several and self.model.switch_replaces_parameters(self.config.switched_model()):
            raise ConfigError(
                f"train.switch_model {self.config.train.switch_model} replaces parameters, which a run on "
                f"{self.trainer.world_size} devices cannot (DDP and FSDP fix them when they wrap the model): "
                "switch to a scheme without parameters (none, rope, alibi; fixed log scaling), or train on one device."
            )
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        self.model.reserve(self.config.train.random_positions)  # the tables random_positions reaches, before compiling

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        # global_step moves only when the optimizer steps: the first micro-batch of the switch step
        step = self.config.train.switch_step()
        if step is not None and self.switched_at is None and self.global_step >= step:
            self.switch_model()

    def switch_model(self) -> None:
        """Switch the model to `train.switch_model` now, keeping the optimizer's state of every parameter that stays."""
        before = set(self.model.parameters())
        self.model.switch(self.config.switched_model())
        self.switched_at = self.global_step
        self.model.reserve(self.config.train.random_positions)  # the new scheme's tables too
        log.info("Step %d: the model switches to %s", self.global_step, self.config.train.switch_model)
        if set(self.model.parameters()) != before:  # AdamW's groups take the new parameters; those kept keep state
            optimizer = self.trainer.strategy.optimizers[0]
            for group, params in zip(optimizer.param_groups, parameter_groups(self.model), strict=True):
                group["params"] = params
            for gone in set(optimizer.state) - set(self.model.parameters()):
                del optimizer.state[gone]

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y, positions=self._random_positions(x, batch_idx))
        self.tokens_seen += x.numel() * self.trainer.world_size  # a shape: no synchronisation
        self.nonfinite |= ~torch.isfinite(loss.detach())
        if self._logging_step():  # read with the step's other metrics, in one transfer (`MetricsWriter`)
            self.pending.update({"train/loss": loss.detach(), "lr": self.lr_schedulers().get_last_lr()[0],
                                 "train/tokens": float(self.tokens_seen)})  # fmt: skip
        return loss

    def _random_positions(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        """With `train.random_positions` N: each row's increasing random positions in [0, N), drawn from (seed,
        micro-batch) alone, so that a resumed run draws the same; else (and for NoPE) None: 0..T-1."""
        t = self.config.train
        if not t.random_positions or not self.model.uses_positions:
            return None
        micro_batch = self.global_step * t.grad_accum + batch_idx % t.grad_accum
        generator = torch.Generator().manual_seed(t.seed * 1_000_003 + micro_batch)
        return random_positions(x.size(0), x.size(1), t.random_positions, generator, x.device)

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        revisit()  # in a command, torch's threads follow the free cores
        # stopping here makes Lightning run the final validation, skipped when max_steps is no multiple of the interval
        if self.global_step >= self.trainer.max_steps:
            self.trainer.should_stop = True

    def _logging_step(self) -> bool:
        """Log only on the steps the logger writes (`self.log` costs a few hundred microseconds a call)."""
        return (self.global_step + 1) % self.trainer.log_every_n_steps == 0

    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros(2, device=self.device, dtype=torch.float64)  # (loss * windows, windows)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        revisit()
        self._val_sum += torch.stack([loss.double() * x.size(0), torch.tensor(x.size(0), device=self.device)])

    def on_validation_epoch_end(self) -> None:
        total = self.trainer.strategy.reduce(self._val_sum, reduce_op="sum")
        loss = (total[0] / total[1]).float()
        self.log("val/loss", loss, sync_dist=False)  # ModelCheckpoint's monitor, read at validation only
        self.logged["val/loss"] = float(loss)
        self.log("val/ppl", torch.exp(loss), sync_dist=False)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:
        """Clip the global gradient norm to `optim.grad_clip`: Lightning's clipping refuses the fused AdamW (even under
        bf16) and cannot clip FSDP by norm (docs/training.md)."""
        if not self.config.optim.grad_clip:
            return
        norm = clip_grad_norm(self.trainer, self, optimizer, self.config.optim.grad_clip)
        if self._logging_step():
            self.pending["train/grad_norm"] = norm.detach()  # before clipping, as nanoGPT-style logs report it

    def configure_optimizers(self):
        optimizer = adamw(self.model, self.config.optim, self.device)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def lr_factor(self, step: int) -> float:
        """The schedule of the current config at optimizer step `step` (a multiple of optim.lr)."""
        o = self.config.optim
        return lr_factor(step, o.lr, o.min_lr, o.warmup_steps, o.decay_steps or self.config.train.max_steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # dropout's random stream, so that a resumed run draws the same masks as an uninterrupted one
        checkpoint["torch_rng"] = torch.get_rng_state()
        checkpoint["tokens_seen"] = self.tokens_seen
        if self._launch_started is not None:
            started, before = self._launch_started
            self.train_seconds = before + time.monotonic() - started
        checkpoint["train_seconds"] = round(self.train_seconds, 3)
        checkpoint["switched_at"] = self.switched_at
        checkpoint["model_config"] = self.model.config.to_dict()  # the model now (after a switch: the new one)
        if torch.cuda.is_available():
            checkpoint["cuda_rng"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the random state, and apply the current optim settings to the optimizer and scheduler states about
        to be restored (unchanged settings write the saved values: a resume stays bit-identical)."""
        o = self.config.optim
        schedulers = checkpoint.get("lr_schedulers") or []
        step = schedulers[0]["last_epoch"] if schedulers else 0
        lr = o.lr * self.lr_factor(step)  # what LambdaLR sets after step `step`
        for scheduler in schedulers:
            scheduler["base_lrs"] = [o.lr] * len(scheduler["base_lrs"])
        states = [state["param_groups"] for state in checkpoint.get("optimizer_states") or []]
        if not self.trainer.strategy.lightning_restore_optimizer:  # FSDP2 has loaded them already: edit the optimizer
            states = [optimizer.param_groups for optimizer in self.trainer.optimizers]
        for groups in states:
            for group, weight_decay in zip(groups, (o.weight_decay, 0.0), strict=True):
                group.update(initial_lr=o.lr, lr=lr, betas=(o.beta1, o.beta2), weight_decay=weight_decay)
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self.train_seconds = checkpoint.get("train_seconds", 0.0)
        self.switched_at = checkpoint.get("switched_at")
        if self.switched_at is not None:  # before the weights load: they are the switched model's
            self.model.switch(self.config.switched_model())
        if "torch_rng" in checkpoint:
            torch.set_rng_state(checkpoint["torch_rng"])
        if "cuda_rng" in checkpoint and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])


def clip_grad_norm(
    trainer: L.Trainer, module: L.LightningModule, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Scale the gradients of `module` to a global L2 norm of at most `max_norm`; returns the norm before."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        # fp16 with a fused optimizer: Lightning leaves unscaling to the optimizer's step, but a norm
        # of scaled gradients is meaningless. After unscale_, GradScaler.step passes no scale on.
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2: the norm over every rank's shards
