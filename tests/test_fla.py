"""flash-linear-attention's kernels behind forgetting and stick-breaking attention (model/kernels/fla.py): held to
posgpt's own kernels under Triton's interpreter in a process of their own (tests/fla_cases.py), where fla-core and
triton are installed; and what `auto` picks on CUDA with fla and without it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posgpt.model import GPT, GPTConfig
from posgpt.model.kernels import KernelError
from posgpt.model.kernels import fla as fla_kernels

HERE = Path(__file__).resolve().parent
INSTALLED = all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


@pytest.mark.slow
@pytest.mark.skipif(not INSTALLED, reason="fla-core and triton are not installed (pip install 'posgpt[fla]')")
def test_fla_kernels_equal_posgpts_under_the_interpreter():
    """tests/fla_cases.py in a process of its own: the interpreter's setting must reach Triton before it loads, and
    no other test may run under it."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "fla_cases.py")],
                          env=env, cwd=HERE.parent, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _picked(**settings) -> str:
    """The kernel `auto` picks for a training step on CUDA of a model of `settings`, by its registry name."""
    config = GPTConfig(**{"vocab_size": 64, "block_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 64, **settings})
    with torch.device("meta"):
        model = GPT(config)
    function = model.kinds[0].attention
    return function.kernel_name(model.kernel(torch.device("cuda"), config.dropout > 0, needs_grad=True))


def test_auto_picks_fla_on_cuda_where_it_runs_and_todays_kernel_for_what_fla_lacks(monkeypatch):
    monkeypatch.setattr(fla_kernels, "fla_runs_on", lambda: frozenset({"cuda"}))
    fox, sb = {"attention": "forgetting"}, {"attention": "stick_breaking", "pos_encoding": "none"}
    assert _picked(**fox, pos_encoding="rope") == _picked(**fox, attn_window=16) == "fla"
    assert _picked(**sb) == "fla"
    assert (
        _picked(attention="gated_deltanet", pos_encoding="none")
        == _picked(attention="kda", pos_encoding="none")
        == "fla"
    )
    assert _picked(**fox, attn_window=16, attn_sinks=2) == "flex"  # a mask beyond a window
    assert _picked(**fox, pos_encoding="alibi") == "flex"  # a position bias
    assert _picked(**fox, dropout=0.1) == "sdpa"
    assert _picked(**sb, attn_window=16) == _picked(**{**sb, "pos_encoding": "alibi"}) == "eager"
    assert _picked(**fox, n_embd=1024) == "flex"  # heads over 256 wide: fla holds a head's keys in one block
    for backend in ("auto", "fla"):  # asked for by name too: decoding runs on the function's own kernels
        config = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=2, n_embd=64, attn_backend=backend, **fox)
        with torch.device("meta"):
            decoding = GPT(config).kernel(torch.device("cuda"), False, needs_grad=False, decoding=True)
        assert not isinstance(decoding, fla_kernels.FlaKernel)


def test_without_fla_auto_keeps_todays_kernels_and_asking_for_it_says_how_to_install(monkeypatch):
    monkeypatch.setattr(fla_kernels, "fla_runs_on", lambda: frozenset())
    monkeypatch.setattr(fla_kernels, "fla_installed", lambda: False)
    assert _picked(attention="forgetting") == "flex" and _picked(attention="stick_breaking") == "eager"
    assert _picked(attention="kda", pos_encoding="none") == "chunked"
    with pytest.raises(KernelError, match=r"needs fla-core 0.6.0: pip install 'posgpt\[fla\]'"):
        _picked(attention="forgetting", attn_backend="fla")
