"""Shared fixtures: a tiny model config, a fixed seed per test, and GPU tests skipped without CUDA."""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posgpt.model import GPTConfig


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slow` first: pytest-xdist hands the first tests out in turn, so the long ones start at once
    on every worker and the workers end together, on short tests (the order is the same in every worker)."""
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A signal that stopped an in-process run which its test did not expect (a SIGTERM or Ctrl+C sent to
    pytest: training catches them, to save), in a test or in a fixture, stops the test session too, as it
    would without the run: the command's exit status, or a stopped run's (`TrainingStopped.exit_code`)."""
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    code = error.code if isinstance(error, SystemExit) else getattr(error, "exit_code", None)
    if code in (130, 128 + signal.SIGTERM):
        pytest.exit(f"stopped: {item.nodeid} ({call.when}) ended with exit status {code}, a signal's", returncode=code)
    return report


@pytest.fixture(autouse=True)
def _one_test_state():
    """Every test starts with no compiled code of another test (Dynamo's caches and recompile counts), and
    leaves the signal handlers as it found them."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    yield
    left = [f"{signal.Signals(n).name} ({now!r})" for n, h in handlers.items() if (now := signal.getsignal(n)) != h]
    assert not left, f"the test left its own {' and '.join(left)} handler installed"


@pytest.fixture(autouse=True, scope="session")
def _one_parser_per_command() -> Iterator[None]:
    """Each command's parser is built once per worker, not at every run (building jsonargparse's parser from the
    dataclasses takes a few tenths of a second, and the suite parses some hundreds of command lines); parsing
    itself is untouched."""
    from posgpt.core import cli

    build, parsers = cli.build_parser, {}

    def built_once(command: cli.Command) -> object:
        if id(command) not in parsers:  # the command is kept beside its parser: its id is not reused
            parsers[id(command)] = (command, build(command))
        return parsers[id(command)][1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "build_parser", built_once)
        yield


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _unrendered_figures(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Figures are built (every curve, marker and legend on its axes) but saved as a bare PNG signature, not
    rendered: rendering takes matplotlib about half a second a figure, and the suite trains and evaluates a
    few hundred times. A test marked `plot` renders its figures (as do subprocesses)."""
    if "plot" in request.keywords:
        return
    from matplotlib.figure import Figure

    def signature_only(fig: Figure, fname: object, *args: object, **kwargs: object) -> None:
        if hasattr(fname, "write"):
            fname.write(PNG_SIGNATURE)
        else:
            Path(fname).write_bytes(PNG_SIGNATURE)

    monkeypatch.setattr(Figure, "savefig", signature_only)


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


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return path


@pytest.fixture
def shakespeare_path() -> Path:
    """The shared Tiny Shakespeare file; the test is skipped where ../shared is absent."""
    return _shared_file("tinyshakespeare.txt")


@pytest.fixture
def gpt2_ranks() -> Path:
    """The shared GPT-2 BPE ranks file (r50k_base.tiktoken); skipped where absent."""
    return _shared_file("r50k_base.tiktoken")


def make_text(n_sentences: int = 400, seed: int = 0) -> str:
    """Generated English-like text with enough structure for a tiny model to learn quickly."""
    rng = random.Random(seed)
    subjects = ["the king", "a fool", "my lord", "the queen", "good sir", "this night"]
    verbs = ["speaks of", "loves", "fears", "remembers", "forgets", "awaits"]
    objects = ["the crown", "his horse", "a sword", "the sea", "her letter", "our fate"]
    lines = []
    for _ in range(n_sentences):
        lines.append(f"{rng.choice(subjects).capitalize()} {rng.choice(verbs)} {rng.choice(objects)}.")
    return "\n".join(lines) + "\n"


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(make_text(), encoding="utf-8")
    return path


if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: the workers share the cores
    torch.set_num_threads(1)
# the tests' count is chosen, so commands keep it (core/threads.py) and subprocesses share it: the same sums bit for bit
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
