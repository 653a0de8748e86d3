"""Shared fixtures: a tiny model config, a fixed seed per test, and GPU tests skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from model import GPTConfig


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_dtype():
    """Every test starts from seed 0 and float32, and leaves the default dtype as it found it."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def tiny_config() -> GPTConfig:
    """2 layers, width 32, 4 heads of 8, vocabulary 64, training context 16."""
    return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
