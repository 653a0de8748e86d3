"""Checkpoints written before the attention core was redesigned (one per position scheme, from
commit eb6b156, in tests/assets/pre-redesign.pt) still load and give the logits they gave then; so do
models recorded before issue 33 made three defaults the papers' (tests/assets/pre-issue33.pt)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posgpt.evaluation.checkpoint import gpt_from_checkpoint, load_checkpoint
from posgpt.model import GPT, GPTConfig
from posgpt.model.config import REMOVED_FIELDS

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


PRE_ISSUE33 = torch.load(Path(__file__).resolve().parent / "assets" / "pre-issue33.pt", weights_only=False)


@pytest.mark.parametrize("case", sorted(PRE_ISSUE33))
def test_a_checkpoint_from_before_the_papers_defaults_computes_as_it_was_trained(case, tmp_path):
    """Issue 33 made sigmoid attention's bias, differential attention's split and BigBird's draws the
    papers'; a checkpoint written before records none of those fields and must keep its own behaviour
    (tests/assets/make_pre_issue33.py wrote these on the code of that time)."""
    saved = PRE_ISSUE33[case]
    ckpt = {"hyper_parameters": {"config": {"model": saved["config"]}},
            "state_dict": {f"model.{k}": v for k, v in saved["state_dict"].items()}}  # fmt: skip
    model = gpt_from_checkpoint(ckpt, tmp_path / f"{case}.ckpt")
    with torch.no_grad():
        logits, _ = model(saved["idx"])
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-6)
    # ... while a new model of the same shape takes the papers' defaults, which compute otherwise
    fresh = GPT(GPTConfig(**{k: v for k, v in saved["config"].items() if k not in REMOVED_FIELDS}))
    fresh.load_state_dict(saved["state_dict"])
    with torch.no_grad():
        assert not torch.allclose(fresh.eval()(saved["idx"])[0], saved["logits"], atol=1e-3)


def test_a_config_that_records_a_removed_field_loads_without_it():
    """linear_backend (who multiplied float32 matrices on a CPU) was removed in issue 35; configs and
    checkpoints written with it still load, as the same model."""
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    assert GPTConfig.from_dict({**config.to_dict(), "linear_backend": "onednn"}) == config
