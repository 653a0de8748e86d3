"""Write pre-issue33.pt in this directory: one tiny model per behaviour that issue 33 changed to its
paper's (sigmoid attention's bias, differential attention's split, BigBird's random blocks), as the
code before it built them (it was run on commit f5f1edb), with its config as a checkpoint recorded it
(no field that issue 33 added), its weights, an input past the training length and the logits that
input gave. tests/test_checkpoint_compat.py checks that such a config still builds the model that gives
those logits. Run from the repository root at that commit: `python tests/assets/make_pre_issue33.py`
(do not re-run it on later code: the point is to keep what the older code computed)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from posgpt.model import GPT, GPTConfig  # noqa: E402

SHAPE = {"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "bias": False}
CASES = {
    "sigmoid": {"attention": "sigmoid", "pos_encoding": "rope"},
    "differential": {"attention": "differential", "pos_encoding": "rope"},
    "bigbird": {"pos_encoding": "alibi", "attn_window": 6, "attn_sinks": 2, "attn_random_blocks": 2,
                "attn_sparse_block": 4},
}  # fmt: skip


def main() -> None:
    bundle = {}
    for name, fields in CASES.items():
        torch.manual_seed(0)
        config = GPTConfig(**SHAPE, **fields)
        model = GPT(config).eval()
        idx = torch.randint(0, SHAPE["vocab_size"], (2, 40))  # past block_size
        with torch.no_grad():
            logits, _ = model(idx)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        bundle[name] = {"config": config.to_dict(), "state_dict": state, "idx": idx, "logits": logits}
    torch.save(bundle, Path(__file__).resolve().parent / "pre-issue33.pt")


if __name__ == "__main__":
    main()
