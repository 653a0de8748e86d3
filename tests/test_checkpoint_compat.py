"""Checkpoints written before the attention core was redesigned (tests/assets, one per position
scheme, from commit eb6b156) still load and give the logits they gave then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.checkpoint import load_checkpoint

ASSETS = Path(__file__).resolve().parent / "assets"
SAVED = torch.load(ASSETS / "main-logits.pt", weights_only=True)


@pytest.mark.parametrize("scheme", sorted(SAVED))
def test_an_older_checkpoint_loads_and_gives_its_logits(scheme):
    ckpt = load_checkpoint(ASSETS / f"main-{scheme}.pt")
    assert ckpt.model.config.pos_encoding == scheme
    idx, expected = SAVED[scheme]
    with torch.no_grad():
        logits, _ = ckpt.model(idx)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
