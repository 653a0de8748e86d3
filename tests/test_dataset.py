"""Training and evaluation windows: shapes, dtypes, determinism, resumable position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posgpt.data.dataset import FixedWindows, SeededStream, load_prepared, random_windows
from posgpt.data.prepare import prepare


@pytest.fixture
def prepared(text_file, tmp_path):
    prepare(str(text_file), str(tmp_path / "out"), "char")
    return load_prepared(tmp_path / "out")


def _stream(prepared, seed: int, start: int = 0, rank: int = 0, n: int = 4):
    batches = iter(SeededStream(random_windows(prepared, 16, batch_size=5, seed=seed, rank=rank), lambda: start))
    return [next(batches) for _ in range(n)]


def test_random_windows_shapes_dtypes_and_targets(prepared):
    tokens = prepared.tokens("train")
    for x, y in _stream(prepared, seed=0):
        assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        for row in x:  # every row is a real window of the corpus
            hits = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, 16) == row.numpy(), axis=1))
            assert hits.size > 0


def test_random_windows_are_a_pure_function_of_seed_rank_and_position(prepared):
    a, b = _stream(prepared, seed=7), _stream(prepared, seed=7)
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b, strict=True))
    other = _stream(prepared, seed=8)
    assert not torch.equal(a[0][0], other[0][0])
    assert not torch.equal(a[0][0], _stream(prepared, seed=7, rank=1)[0][0])
    resumed = _stream(prepared, seed=7, start=2, n=2)  # what a run resumed after 2 batches draws
    assert torch.equal(resumed[0][0], a[2][0]) and torch.equal(resumed[1][0], a[3][0])


def test_fixed_windows_do_not_overlap_and_respect_the_budget(prepared):
    val = prepared.tokens("val")
    windows = FixedWindows(prepared, "val", block_size=16, batch_size=4)
    xs = torch.cat([windows[i][0] for i in range(len(windows))])
    assert xs.shape[0] == (len(val) - 1) // 16
    assert torch.equal(xs.flatten(), torch.from_numpy(val[: xs.numel()].astype(np.int64)))
    assert torch.equal(windows[0][0], FixedWindows(prepared, "val", 16, 4)[0][0])  # fixed, not random
    budget = FixedWindows(prepared, "val", block_size=16, batch_size=4, max_tokens=100)
    assert sum(budget[i][0].shape[0] for i in range(len(budget))) == 100 // 16
