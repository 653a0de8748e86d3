"""Checkpoints written before the attention core was redesigned (one per position scheme, from
commit eb6b156, in tests/assets/pre-redesign.pt) still load and give the logits they gave then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evaluation.checkpoint import load_checkpoint

BUNDLE = torch.load(Path(__file__).resolve().parent / "assets" / "pre-redesign.pt", weights_only=False)


@pytest.mark.parametrize("scheme", sorted(BUNDLE))
def test_an_older_checkpoint_loads_and_gives_its_logits(scheme, tmp_path):
    saved = BUNDLE[scheme]
    path = tmp_path / f"{scheme}.ckpt"
    torch.save(saved["checkpoint"], path)  # as train.py wrote it (less the optimizer and loop state)
    ckpt = load_checkpoint(path)
    assert ckpt.model.config.pos_encoding == scheme
    with torch.no_grad():
        logits, _ = ckpt.model(saved["idx"])
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-6)
