"""The golden loss curves that guard every refactoring: a fixed seed's first 50 training losses of
tiny models, float32 on the CPU.

- `trainer`: `train.py` itself (the Lightning module, the data stream, gradient accumulation,
  dropout, clipping, the LR schedule) on a generated corpus, the default RoPE model made tiny.
- one curve per attention path (scheme x kernel x mask x score x attention function): a plain
  AdamW loop over the model alone, so that a change inside `model/` shows where it happened.

`tests/test_golden.py` compares a fresh run with `tests/assets/golden_losses.json` (rtol 1e-6, so
that CPUs with other float32 kernels pass; on the machine that wrote the file they are
bit-identical). Rewrite the file only for a change that is meant to change training:
`python tests/golden.py` from the repository root.
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "assets" / "golden_losses.json"
STEPS = 50

MODELS: dict[str, dict[str, Any]] = {
    "learned-auto": {"pos_encoding": "learned"},
    "sinusoidal-eager": {"pos_encoding": "sinusoidal", "attn_backend": "eager"},
    "rope-window-sinks": {"pos_encoding": "rope", "attn_window": 8, "attn_sinks": 2},
    "alibi-sdpa": {"pos_encoding": "alibi", "attn_backend": "sdpa"},
    "t5-eager": {"pos_encoding": "t5", "attn_backend": "eager"},
    "none-dot": {"pos_encoding": "none", "attn_score": "dot"},
    "rope-additive": {"pos_encoding": "rope", "attn_score": "additive"},
    "linear-rope-chunked": {"pos_encoding": "rope", "attention": "linear"},
    "linear-none-eager": {"pos_encoding": "none", "attention": "linear", "attn_backend": "eager"},
    "alibi-random-positions": {"pos_encoding": "alibi", "random_positions": 64},
    "kerple-sdpa": {"pos_encoding": "kerple"},
    "fire-eager": {"pos_encoding": "fire", "attn_backend": "eager"},
    "fire-per-layer": {"pos_encoding": "fire", "fire_per_layer": True},
    "sigmoid-alibi": {"pos_encoding": "alibi", "attention": "sigmoid"},
    "differential-rope": {"pos_encoding": "rope", "attention": "differential"},
    "bigbird-rope": {
        "pos_encoding": "rope",
        "attn_window": 8,
        "attn_sinks": 2,
        "attn_random_blocks": 2,
        "attn_sparse_block": 8,
    },
    "partial-rope-log-n": {"pos_encoding": "rope", "rope_fraction": 0.5, "attn_log_scaling": "fixed"},
}
"""Model settings of each curve (GPTConfig fields; `random_positions` N: each batch's rows at an
increasing random subset of [0, N))."""


def model_curve(settings: dict[str, Any], steps: int = STEPS) -> list[float]:
    """The first `steps` losses of a 2-layer, 4-head, 32-wide model with `settings`, trained by AdamW
    on batches of 4 windows of 32 tokens of a random text, all drawn from a fixed generator."""
    from posgpt.model import GPT, GPTConfig
    from posgpt.model.positions import random_positions

    fields = {k: v for k, v in settings.items() if k != "random_positions"}
    torch.manual_seed(1337)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, **fields))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = torch.Generator().manual_seed(0)
    text = torch.randint(0, 64, (256,), generator=data)  # windows of one short random text: learnable
    losses = []
    for _ in range(steps):
        offsets = torch.randint(0, text.numel() - 33, (4, 1), generator=data)
        idx = text[offsets + torch.arange(33)]  # (4, 33)
        ids = None
        if "random_positions" in settings:
            model.pe.reserve(settings["random_positions"])
            ids = random_positions(4, 32, settings["random_positions"], data)
        _, loss = model(idx[:, :-1], idx[:, 1:], positions=ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def trainer_curve(tmp: Path, text_file: Path, steps: int = STEPS) -> list[float]:
    """The first `steps` train/loss values that `train.py` logs for a tiny RoPE model with dropout and
    two micro-batches per step, float32 on the CPU."""
    import train as train_script
    from posgpt.core import cli
    from posgpt.training.logs import metrics_file

    cli.run(train_script.COMMAND, [
        "--model.n_layer", "2", "--model.n_head", "4", "--model.n_embd", "32", "--model.block_size", "32",
        "--model.dropout", "0.1",
        "--train.batch_size", "4", "--train.grad_accum", "2",
        "--train.max_steps", str(steps), "--train.log_interval", "1", "--train.eval_interval", str(steps),
        "--train.progress_bar", "false", "--train.sample_tokens", "0", "--train.precision", "32-true",
        "--train.accelerator", "cpu", "--optim.lr", "3e-3", "--optim.warmup_steps", "5",
        "--data.input", str(text_file), "--data.prepared_root", str(tmp / "prepared"),
        "--train.out_dir", str(tmp / "runs"), "--train.run_name", "golden",
    ])  # fmt: skip
    with open(metrics_file(tmp / "runs" / "golden")) as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def all_curves() -> dict[str, list[float]]:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from conftest import make_text

    curves = {name: model_curve(settings) for name, settings in MODELS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "corpus.txt"
        text_file.write_text(make_text(), encoding="utf-8")
        curves["trainer"] = trainer_curve(Path(tmp), text_file)
    return curves


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(all_curves(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
