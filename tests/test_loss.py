"""The chunked output layer + cross-entropy (model/loss.py) is F.cross_entropy on the whole logits:
the loss and the gradients of the states and of the head, ignored targets and the padded vocabulary
included, in one chunk or many."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from posgpt.model import GPT
from posgpt.model import loss as chunked


@pytest.mark.parametrize("chunk_elements", [1 << 24, 70 * 3])  # one chunk; chunks of 3 rows (the last of 2)
def test_the_chunked_loss_is_cross_entropy_on_the_whole_logits(monkeypatch, chunk_elements):
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", chunk_elements)
    hidden = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(70, 16, dtype=torch.float64, requires_grad=True)  # 65 ids + 5 padding rows
    targets = torch.randint(0, 65, (11,))
    targets[[2, 7]] = -1  # ignored
    expected = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-1)
    grads = torch.autograd.grad(expected, (hidden, weight))
    loss = chunked.linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss * 1.0, (hidden, weight)), grads, strict=True):
        torch.testing.assert_close(got, want)
    assert torch.isnan(chunked.linear_cross_entropy(hidden, weight, torch.full((11,), -1)))  # as F.cross_entropy


def test_a_model_with_the_chunked_loss_trains_as_the_plain_one(tiny_config, monkeypatch):
    """Same weights, same batch (with ignored targets): the same loss and every parameter's gradient."""
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 64 * 5)  # chunks of 5 rows
    plain = GPT(dataclasses.replace(tiny_config, vocab_size=60))  # padded to 64
    fused = GPT(dataclasses.replace(tiny_config, vocab_size=60, chunked_loss=True))
    fused.load_state_dict(plain.state_dict())
    x, y = torch.randint(0, 60, (2, 2, 16)).unbind(0)
    y[0, :3] = -1
    logits, expected = plain(x, y)
    none, loss = fused(x, y)
    assert logits is not None and none is None
    torch.testing.assert_close(loss, expected)
    expected.backward()
    loss.backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name, atol=1e-6, rtol=1e-5)
