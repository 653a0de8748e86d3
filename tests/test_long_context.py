"""Long contexts in memory that grows linearly with the length: past `DENSE_ELEMENTS` the eager and
SDPA kernels take the queries in blocks of rows and no (H, T, T) bias or mask is ever formed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posgpt.model import GPT
from posgpt.model.kernels import dense

T = 256


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.most = max(self.most, tensor.numel())
        return out


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_no_t_by_t_tensor_past_the_dense_limit_and_the_same_logits(tiny_config, monkeypatch, backend, scheme):
    """At 256 tokens with a limit of 2^13 elements (blocks of 8 query rows for 4 heads), no tensor of
    a forward pass is larger than the MLP's hidden layer (T x 4C = 32768 < T x T), and the logits are
    those of the whole mask and bias (up to float rounding)."""
    config = dataclasses.replace(tiny_config, pos_encoding=scheme, attn_backend=backend)
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (1, T))
    with torch.no_grad():
        whole, _ = model(idx)
        monkeypatch.setattr(dense, "DENSE_ELEMENTS", 1 << 13)
        with LargestTensor() as largest:
            blocked, _ = model(idx)
    assert largest.most <= T * 4 * config.n_embd  # the MLP's hidden layer: linear in T
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)
