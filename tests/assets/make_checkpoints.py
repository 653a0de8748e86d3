"""Write pre-redesign.pt in this directory: one tiny checkpoint per position scheme, trained for
3 steps by `train.py` as it stood before the attention core was redesigned (issue 11; it was run
on commit eb6b156), with the logits each gave on a fixed input, in one file of about 70 KB (the
checkpoints without their optimizer and loop state). tests/test_checkpoint_compat.py checks that
they still load and give those logits. Run from the repository root: `python
tests/assets/make_checkpoints.py` (do not re-run it after changing the model: the point is to keep
what the older code wrote)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import make_text  # noqa: E402

import train as train_script  # noqa: E402
from posgpt.core import cli  # noqa: E402
from posgpt.evaluation.checkpoint import load_checkpoint  # noqa: E402
from posgpt.model import POS_ENCODINGS  # noqa: E402

HERE = Path(__file__).resolve().parent


KEEP = ("epoch", "global_step", "pytorch-lightning_version", "state_dict", "hparams_name", "hyper_parameters")
"""What a test needs of a checkpoint: weights, config and tokenizer (not the optimizer or loops)."""


def main() -> None:
    bundle = {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text(make_text(200))
        for scheme in POS_ENCODINGS:
            cli.run(train_script.COMMAND, [
                "--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "8", "--model.block_size", "8",
                "--model.pos_encoding", scheme, "--model.bias", "true", "--train.batch_size", "2",
                "--train.max_steps", "3", "--train.eval_interval", "3", "--train.eval_tokens", "32",
                "--train.logger", "none", "--train.progress_bar", "false", "--train.sample_tokens", "0",
                "--data.input", str(text), "--data.prepared_root", f"{tmp}/prepared",
                "--train.out_dir", f"{tmp}/runs", "--train.run_name", scheme,
            ])  # fmt: skip
            path = Path(tmp) / "runs" / scheme / "last.ckpt"
            ckpt = torch.load(path, weights_only=False)
            model = load_checkpoint(path).model
            idx = torch.arange(12).remainder(model.config.vocab_size)[None]  # 12 > block_size: past it where possible
            n = idx.size(1) if model.pe.max_positions is None else model.pe.max_positions
            with torch.no_grad():
                logits = model(idx[:, :n])[0]
            bundle[scheme] = {
                "checkpoint": {k: ckpt[k] for k in KEEP if k in ckpt},
                "idx": idx[:, :n],
                "logits": logits,
            }
    torch.save(bundle, HERE / "pre-redesign.pt")


if __name__ == "__main__":
    main()
