"""Helpers shared by the tests: attention parity runs, overfitting, tiny training runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig
from posgpt.model.positions import PositionEncoding
from posgpt.model.terms import Term


def scheme_kinds() -> dict[str, str]:
    """One registered scheme of each kind, read from what the schemes declare and implement (never their names):
    the first that rotates queries and keys, the first fixed score bias and the first learned one."""

    def first(kind: Any) -> str:
        return next(name for name, scheme in SCHEMES.items() if kind(scheme))

    return {
        "rotation": first(lambda s: s.rotate is not PositionEncoding.rotate),
        "fixed bias": first(lambda s: Term.POSITIONS in s.terms and not s.learned_bias),
        "learned bias": first(lambda s: Term.POSITIONS in s.terms and s.learned_bias),
    }


def lengths(config: GPTConfig, odd_len: int) -> list[int]:
    """A length that is not a multiple of 16 for every scheme, plus 4 x block_size for those that
    extrapolate (those with no longest position)."""
    if SCHEMES[config.pos_encoding].longest(config) is not None:
        return [odd_len]
    return [odd_len, 4 * config.block_size]


def build(config: GPTConfig, scheme: str, backend: str) -> GPT:
    return GPT(dataclasses.replace(config, pos_encoding=scheme, attn_backend=backend))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def run_pair(config: GPTConfig, scheme: str, backend: str, device: torch.device, dtype: torch.dtype, odd_len: int):
    """Yield, for each test length, the float32 reference's (the kernel of `config.attention` that
    forms the weights: eager) and `backend`'s logits and gradients (None where `backend` has no
    backward pass on `device`), from the same weights and input; `backend` runs under autocast to
    `dtype` unless that is float32."""
    kernels = ATTENTIONS[config.attention].kernels
    reference_name = next(name for name, kernel in kernels.items() if kernel.weights)  # the reference path
    reference = build(config, scheme, reference_name).to(device)
    candidate = build(config, scheme, backend).to(device)
    candidate.load_state_dict(reference.state_dict())
    backward = kernels[backend].backward_devices
    with_grad = backward is None or device.type in backward
    for T in lengths(reference.config, odd_len):
        idx = torch.randint(0, config.vocab_size, (2, T), device=device)
        targets = torch.randint(0, config.vocab_size, (2, T), device=device)
        results = []
        for model, autocast in ((reference, False), (candidate, dtype != torch.float32)):
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(with_grad), torch.autocast(device.type, dtype, enabled=autocast):
                logits, loss = model(idx, targets)
            grads = None
            if with_grad:
                loss.backward()
                grads = {name: p.grad.float() for name, p in model.named_parameters()}
            results.append((logits.float(), grads))
        yield T, results[0], results[1]


def is_flex(kernel: Any) -> bool:
    """A FlexAttention kernel (softmax's, sigmoid's): on a CPU it runs only under `uncompiled_flex`."""
    from posgpt.model.kernels.flex import FlexKernel

    return isinstance(kernel, FlexKernel)


def uncompiled_flex(monkeypatch) -> None:
    """Let every flex kernel run on the CPU, through FlexAttention's uncompiled path: compiled flex is
    refused there (it returns wrong numbers in torch 2.13: model/kernels/flex.py), the uncompiled one is
    exact, so the kernels' block masks and score_mods are checked against the dense path this way.
    Forward only: FlexAttention has no backward pass on a CPU. Its eager path, which calls the score_mod under
    vmap, runs directly rather than traced by Dynamo first (the flag torch offers to debug a score_mod): the
    same computation, without seconds of tracing for every new model and length."""
    import torch.nn.attention.flex_attention as torch_flex

    import posgpt.model.kernels.flex as flex

    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    flex_attention = torch_flex.flex_attention
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: flex_attention)  # sigmoid's flex calls it too
    for layer in ATTENTIONS.values():
        for kernel in layer.kernels.values():
            if is_flex(kernel):
                monkeypatch.setattr(type(kernel), "devices", None)


def assert_flex_matches_eager(config: GPTConfig, length: int) -> None:
    """The same weights on flex (forward only: on a CPU under `uncompiled_flex`) and on eager give the
    same logits for two random sequences of `length` tokens."""
    torch.manual_seed(0)
    eager = GPT(dataclasses.replace(config, attn_backend="eager")).eval()
    flex = GPT(dataclasses.replace(config, attn_backend="flex")).eval()
    flex.load_state_dict(eager.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, length))
    with torch.no_grad():
        torch.testing.assert_close(flex(idx)[0], eager(idx)[0], rtol=1e-4, atol=1e-5)


def scheme_gradients(config: GPTConfig, length: int, backends: tuple[str, ...] = ("eager", "sdpa")) -> list[dict]:
    """For each backend, from the same seed: the gradient of the position scheme's every parameter
    after one loss on two random sequences of `length` + 1 tokens (the same on each)."""
    grads = []
    for backend in backends:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(config, attn_backend=backend))
        idx = torch.randint(0, config.vocab_size, (2, length + 1))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        grads.append({name: p.grad for name, p in model.pe.named_parameters()})
    return grads


def overfit(model: GPT, steps: int = 150, lr: float = 3e-3, seed: int = 0) -> tuple[float, float]:
    """Train `model` on one fixed batch of random tokens (4 x 16 + 1); return the loss before and
    after. Memorising it shows that gradients reach every part of the model."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (4, 17), generator=generator)
    x, y = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    first = model(x, y)[1].item()
    for _ in range(steps):
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return first, model(x, y)[1].item()


def direct_loss(model: GPT, tokens: np.ndarray, length: int, stride: int, budget: int) -> float:
    """The extrapolation loss computed the slow, obvious way: one window at a time, advancing by
    `stride`, scoring the last `stride` tokens of each, until `budget` tokens are scored."""
    losses = []
    start = 0
    while start + length + 1 <= len(tokens) and len(losses) < budget:
        window = torch.from_numpy(tokens[start : start + length + 1].astype(np.int64))[None]
        with torch.no_grad():
            logits, _ = model(window[:, :-1])
        for pos in range(length - stride, length):
            losses.append(F.cross_entropy(logits[0, pos], window[0, pos + 1]).item())
        start += stride
    return sum(losses) / len(losses)


def assert_png(path: Path) -> None:
    """`path` decodes as a picture of some size: rendered, not the PNG signature that unmarked tests write."""
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 100, (path, image.shape)


TINY = [
    "--model.n_layer", "2", "--model.n_head", "4", "--model.n_embd", "32", "--model.block_size", "32",
    "--train.batch_size", "8", "--train.log_interval", "5", "--train.progress_bar", "false",
    "--train.sample_tokens", "0", "--optim.lr", "3e-3", "--optim.warmup_steps", "5",
]  # fmt: skip


def tiny_args(tmp_path: Path, text_file: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        "--data.input", str(text_file),
        "--data.prepared_root", str(tmp_path / "prepared"),
        "--train.out_dir", str(tmp_path / "runs"),
        "--train.run_name", "tiny",
        *extra,
    ]  # fmt: skip


def straight_and_resumed(tmp_path: Path, text_file: Path, steps: int, *extra: str) -> tuple[dict, dict]:
    """State dicts of a `steps`-step tiny run, and of the same run stopped halfway and resumed."""
    import train as train_script
    from posgpt.core import cli
    from posgpt.core.checkpoint import read_checkpoint

    straight, split = tmp_path / "straight", tmp_path / "split"
    cli.run(train_script.COMMAND, tiny_args(straight, text_file, *extra, "--train.max_steps", str(steps)))
    cli.run(train_script.COMMAND, tiny_args(split, text_file, *extra, "--train.max_steps", str(steps // 2)))
    cli.run(
        train_script.COMMAND,
        tiny_args(split, text_file, *extra, "--train.max_steps", str(steps), "--train.resume", "auto"),
    )
    return tuple(read_checkpoint(d / "runs" / "tiny" / "last.ckpt")["state_dict"] for d in (straight, split))


def train_tiny(tmp: Path, text: Path, name: str, seed: int = 1337, **model_fields: Any) -> Path:
    """A 25-step run of a 2-layer, 4-head model on `text` (runs under tmp/runs/<name>); its last.ckpt."""
    from posgpt.training.config import DataConfig, OptimConfig, RunConfig, TrainConfig
    from posgpt.training.run import train

    model = {"block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "bias": False, **model_fields}
    cfg = RunConfig(
        model=GPTConfig(**model),
        data=DataConfig(input=str(text), prepared_root=str(tmp / "prepared")),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        train=TrainConfig(max_steps=25, batch_size=8, eval_interval=25, seed=seed, out_dir=str(tmp / "runs"),
                          run_name=name, logger="none", progress_bar=False, sample_tokens=0),
    )  # fmt: skip
    return train(cfg).last_ckpt


def cli_error(capsys, command, argv: list[str], code: int = 2) -> str:
    """The `error: ...` line a command ends with (`core.cli.run`): the last line on stderr (training
    may have logged before it), after exit status `code` and no traceback."""
    import pytest

    from posgpt.core import cli

    with pytest.raises(SystemExit) as info:
        cli.run(command, argv)
    err = capsys.readouterr().err
    assert info.value.code == code and "Traceback" not in err, (info.value.code, err[-3000:])
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and err.count("error: ") == 1, err[-3000:]  # one line, the last
    return line


def eager_with_weights(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager reference's output and its whole (B, H, Tq, Tk) weights, gathered from its hook."""
    from posgpt.model.kernels import eager_attention

    chunks: list[torch.Tensor] = []
    out = eager_attention(q, k, v, on_weights=lambda rows, weights: chunks.append(weights), **kwargs)
    return out, torch.cat(chunks, dim=2)


def signal_during(
    monkeypatch, method: str, run_name: str, step: int, batch_idx: int | None = None, signum: int | None = None
) -> None:
    """Make `GPTModule.<method>` (training_step or validation_step) send this process a real signal
    (default SIGTERM) in run `run_name` at optimizer step `step` (and batch `batch_idx`, if given): a
    kill at a chosen point."""
    import os
    import signal

    from posgpt.training.module import GPTModule

    original = getattr(GPTModule, method)

    def signalled(self, batch, index):
        if self.config.train.run_name == run_name and self.global_step == step and batch_idx in (None, index):
            os.kill(os.getpid(), signum or signal.SIGTERM)
        return original(self, batch, index)

    monkeypatch.setattr(GPTModule, method, signalled)


def exits_with(capsys, command, argv: list[str], code: int) -> str:
    """Run `command` expecting it to exit with `code`; its stderr."""
    import pytest

    from posgpt.core import cli

    with pytest.raises(SystemExit) as info:
        cli.run(command, argv)
    err = capsys.readouterr().err
    assert info.value.code == code, err[-3000:]
    return err


WALL_TIME_FIELDS = frozenset({"created", "train_seconds", "train_wall_s", "eval_wall_s", "total_wall_s"})
LAUNCH_FIELDS = frozenset({"resume"})
"""Settings of the launch that wrote a checkpoint (a study resumes only the runs it had begun)."""


def comparable_report(report: Path, root: Path) -> dict:
    """A study's results.json without its wall-time and launch fields and with `root` (its tree) as ROOT: what an
    interrupted and resumed study must share with an uninterrupted one."""
    import json

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in WALL_TIME_FIELDS | LAUNCH_FIELDS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(json.loads((report / "results.json").read_text().replace(str(root), "ROOT")))


def loaded(modes):
    """`modes` with every `Lazy` imported: the whole tree of commands (for the tests that walk them all)."""
    from posgpt.core.cli import Command
    from posgpt.core.modes import Lazy

    out = {}
    for name, mode in modes.items():
        mode = mode.load() if isinstance(mode, Lazy) else mode
        out[name] = mode if isinstance(mode, Command) else loaded(mode)
    return out


def one_block_logits(model: GPT, idx: torch.Tensor, head: Any) -> torch.Tensor:
    """A 1-layer model's logits with its attention written out key by key: `head(b, i, h, q, k, v, hidden)` is
    query i's output (D,) in head h of row b, from q, k, v (B, T, H, D) and the layer input `hidden` (B, T, C);
    the block around it is GPT-2's (pre-LayerNorm, GELU MLP, tied head)."""
    block, (B, T), H, D = model.blocks[0], idx.shape, model.config.n_head, model.config.head_dim
    x = model.wte(idx)
    hidden = block.ln_1(x)
    q, k, v = (t.view(B, T, H, D) for t in block.attn.qkv(hidden).split(H * D, dim=-1))
    out = torch.stack([torch.stack([torch.cat([head(b, i, h, q, k, v, hidden) for h in range(H)]) for i in range(T)])
                       for b in range(B)])  # fmt: skip
    x = x + block.attn.proj(out)
    x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))


def assert_model_is_its_formula(
    model: GPT, idx: torch.Tensor, head: Any, tolerance: float = 1e-10
) -> dict[str, torch.Tensor]:
    """A float64 1-layer model's logits and every parameter's gradient (of a random weighting of the logits) equal
    those of the same model with its attention written out from a paper, a head at a time (`one_block_logits`), to
    `tolerance` (relative: float64's, or float32's where the model forms a term in float32); the model's gradients."""
    logits, _ = model(idx)
    weight = torch.randn_like(logits)
    (logits * weight).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = one_block_logits(model, idx, head)
    (expected * weight).sum().backward()
    torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=10 * tolerance, atol=tolerance, msg=name)
    return grads


def layer_variants(config: GPTConfig) -> dict[str, dict[str, Any]]:
    """Each of the layer's own options (the fields of role `LAYER`) at the values its type gives, each alone: every
    other value of a Literal or a table of names, True, one KV head and half the heads, a soft-cap of 2 (where scores
    reach it); and a recurrent hybrid layout, a Gated DeltaNet kind beside one of the model's own settings."""
    from typing import Literal, get_args, get_origin, get_type_hints

    from posgpt.model.roles import Role
    from posgpt.model.validation import registries

    hints, names = get_type_hints(GPTConfig), registries([])
    variants: dict[str, dict[str, Any]] = {}
    for name in GPTConfig.fields_with(Role.LAYER):
        hint, default = hints[name], GPTConfig.__dataclass_fields__[name].default
        if get_origin(hint) is Literal or name in names:
            values = [v for v in (names[name] if name in names else get_args(hint)) if v != default]
        elif hint is bool:
            values = [True]
        elif hint is float:
            values = [2.0]
        else:  # a head count
            values = sorted({1, config.n_head // 2})
        variants.update({f"{name}={value}": {name: value} for value in values})
    variants["layout=delta,other"] = {  # a recurrent hybrid: a Gated DeltaNet kind beside the function's own
        "layout": ("delta", "other"),
        "kinds": {"delta": {"attention": "gated_deltanet", "attn_backend": "chunked"}, "other": {}},
    }
    return variants


def project_files(pattern: str = "*.py") -> list[Path]:
    """The project's own files matching `pattern`, from the checkout's root: tracked or new, never what git ignores
    (a `.venv` inside the checkout, as the README makes it, runs/, prepared/); without git, a walk that skips
    virtual environments and site-packages."""
    import fnmatch
    import subprocess

    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern], cwd=root,
                            capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
    if listed:
        return [root / name for name in listed if (root / name).is_file()]
    skipped = {".git", ".venv", "venv", "site-packages", "build", "runs"}
    return [path for path in root.rglob("*") if path.is_file() and fnmatch.fnmatch(path.name, pattern)
            and not skipped & set(path.relative_to(root).parts)]  # fmt: skip


def fidelity(what: str, **row: str) -> Any:
    """Marks a test as one that pins row `what` of docs/model.md's fidelity table (each scheme, function and option
    against its paper's code). One of a row's tests gives its cells: `paper`, `code` (the official code followed),
    `default` and `deviations` (each with the option that gives the other behaviour); tests/docs_tables.py reads
    these marks from the source, with the names of the tests that carry them, and writes the table."""
    return lambda test: test
