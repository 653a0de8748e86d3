"""`posgpt check`: every attention kernel this device runs against the float32 reference path, for every
attention function, scheme, mask, score and option read from the registries and `GPTConfig`'s fields
(a new entry is checked without a line here); the KV cache against a full forward pass; the compiled
model on request (docs/model.md). Each case is a tiny model from one seed whose reference kernel and
candidate kernel share every weight and input.

The error is max |candidate - reference| / max |reference| (for gradients, per parameter, the largest).
Tolerances: float32 1e-4, where kernels differ only in the order of their sums (about 1e-6 measured on
a CPU; room for a GPU's reductions and the softmax's amplification, while a kernel off by 1e-2 fails
100-fold); bfloat16 5e-2: 8 bits of mantissa (2^-9 per operation) rounded some ten times through a
2-layer model, so the whole model's bf16 error, not the kernel's, sets the floor.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys
import time
import typing
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posgpt.core.cli import Command
from posgpt.core.device import pick_device
from posgpt.core.errors import ConfigError, UserError
from posgpt.core.files import atomic_write_bytes
from posgpt.model import ATTENTIONS, GPT, SCHEMES, GPTConfig
from posgpt.model.kernels import KernelError
from posgpt.model.scores import SCORES

BASE: dict[str, Any] = {"vocab_size": 64, "block_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 64}
"""Heads of 32: FlexAttention on CUDA needs 16 or more, and differential attention halves them."""
LENGTHS = (1, 24, 40, 127, 129)
"""Tiles of 16, 64 and 128 and their edges, and past block_size."""
QUICK_LENGTH = 24
CACHE_LENGTH = 40
"""Past a window's 20 + 3 slots, so the rolling cache wraps."""
COMPILED_LENGTH = 40
"""Past a 16-key tile's edge and 8 mod 16 (where compiled flex failed on a CPU)."""
MASKS: dict[str, dict[str, int]] = {
    "causal": {},
    "window": {"attn_window": 20},
    "window+sinks": {"attn_window": 20, "attn_sinks": 3},
    "bigbird": {"attn_window": 20, "attn_sinks": 3, "attn_random_blocks": 2, "attn_sparse_block": 16},
    "chunk": {"attn_chunk": 20},
}
AXES = frozenset({"pos_encoding", "attention", "attn_score", "attn_backend", "attn_window", "attn_sinks",
                  "attn_random_blocks", "attn_sparse_block", "attn_chunk"})  # fmt: skip
"""GPTConfig fields that the case grid sets itself."""
NOT_ATTENTION = frozenset({"bias", "chunked_loss"})
"""Choice fields that leave the attention math alone (chunked_loss returns no logits)."""
COMPANIONS: dict[str, dict[str, Any]] = {
    "rope_scaling": {"rope_scaling_factor": 4.0},
    "rope_partial": {"rope_fraction": 0.5},
    "attn_random_draw": MASKS["bigbird"],
}
"""What an option needs beside it to change anything."""
NUMERIC: dict[str, dict[str, Any]] = {
    "rope_fraction=0.5": {"rope_fraction": 0.5},
    "n_kv_head=1": {"n_kv_head": 1},
    "attn_softcap=2": {"attn_softcap": 2.0},
    "attn_temperature_floor=16": {"attn_temperature_floor": 16},
    "layout=local,global": {"layout": ("local", "global"),
                            "kinds": {"local": {"attn_window": 20}, "global": {"pos_encoding": "none"}}},
    "layout=delta,other": {"layout": ("delta", "other"),  # a recurrent hybrid: the delta kind on its chunked kernel
                           "kinds": {"delta": {"attention": "gated_deltanet", "attn_backend": "chunked"}, "other": {}}},
}  # fmt: skip
"""Numeric and structured options that change the attention math, at one value each."""
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
"""Largest error that passes, by the candidate's dtype."""
GRADIENT_FLOOR = 1e-3
"""A gradient's scale is at least this share of the model's largest: a gradient zero in exact arithmetic
(FIRE's output bias, which the softmax ignores) is float noise, not a scale to divide by."""


@dataclass
class CheckConfig:
    """Options of `posgpt check`."""

    device: str = "auto"
    """Where to check: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N."""
    quick: bool = False
    """One length (24), forward passes only (no gradients, no cache), nothing compiled: a smoke test in seconds."""
    compile: bool = False
    """Also check the model under torch.compile, for every kernel, scheme and mask (on a CPU, seconds per case)."""
    json: str | None = None
    """Write every case and the summary to this JSON file."""
    only: str | None = None
    """Run only the cases whose name contains this text (say softmax/alibi or sdpa)."""
    verbose: bool = False
    """Print every row as it finishes (case, check, error, tolerance, time, why skipped), not only the failures."""


@dataclass
class Result:
    """One row of the table; `passed` None: skipped."""

    case: str
    check: str
    error: float | None = None
    tolerance: float | None = None
    passed: bool | None = None
    seconds: float = 0.0
    skipped: str | None = None


def option_variants() -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, fields) for each non-default value of every choice field (Literal or bool) of `GPTConfig`
    that is not an axis of the grid, with its companions; then `NUMERIC`."""
    hints = typing.get_type_hints(GPTConfig)
    for f in dataclasses.fields(GPTConfig):
        kind = hints[f.name]
        if f.name in AXES | NOT_ATTENTION or (kind is not bool and typing.get_origin(kind) is not typing.Literal):
            continue
        for value in (True, False) if kind is bool else typing.get_args(kind):
            if value != f.default:
                yield f"{f.name}={value}", {**COMPANIONS.get(f.name, {}), f.name: value}
    yield from NUMERIC.items()


def grid() -> Iterator[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """(name, fields, the option variant's fields or None): each function x scheme x mask x score, then
    each option variant with each function and scheme."""
    for function, scheme, (mask, fields), score in itertools.product(ATTENTIONS, SCHEMES, MASKS.items(), SCORES):
        name = f"{function}/{scheme}/{mask}/{score}"
        yield name, {"attention": function, "pos_encoding": scheme, "attn_score": score, **fields}, None
    for (label, extra), function, scheme in itertools.product(option_variants(), ATTENTIONS, SCHEMES):
        fields = {"attention": function, "pos_encoding": scheme, "attn_score": GPTConfig.attn_score, **extra}
        yield f"{function}/{scheme}/{label}", fields, extra


def build(fields: dict[str, Any], backend: str, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**BASE, **fields, attn_backend=backend)).to(device)


def reference_name(function: str) -> str:
    return next(name for name, kernel in ATTENTIONS[function].kernels.items() if kernel.weights)


def error_of(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """max |actual - expected| / max(max |expected|, floor) (absolute where both are zero), in float64."""
    actual, expected = actual.double(), expected.double()
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, floor)
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def run_model(model: GPT, idx: torch.Tensor, dtype: torch.dtype, grad: bool) -> tuple[torch.Tensor, dict | None]:
    """Logits (float32) and, with `grad`, every parameter's gradient of the loss on next tokens."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad), torch.autocast(idx.device.type, dtype, enabled=dtype != torch.float32):
        logits, loss = model(idx, idx.roll(-1, dims=1))
    if not grad:
        return logits.float(), None
    loss.backward()
    return logits.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def cache_error(model: GPT, length: int) -> float:
    """A prompt, single tokens and a chunk through the cache against one full forward pass."""
    n = min(length, model.pe.max_positions or length)
    idx = torch.randint(0, BASE["vocab_size"], (2, n), generator=torch.Generator().manual_seed(7))
    idx = idx.to(model.wte.weight.device)
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(n, batch=2, longest=n)
        prompt, singles = max(1, n // 2), min(4, n - max(1, n // 2))  # then the rest as one chunk
        pieces = [idx[:, :prompt], *idx[:, prompt : prompt + singles].split(1, dim=1), idx[:, prompt + singles :]]
        pieces = [piece for piece in pieces if piece.size(1)]
        steps = torch.cat([model(piece, cache=cache)[0] for piece in pieces], dim=1)
    return error_of(steps.float(), full.float())


def judge(case: str, check: str, error: float, dtype: torch.dtype, started: float) -> Result:
    return Result(case, check, error, TOLERANCE[dtype], error <= TOLERANCE[dtype], time.perf_counter() - started)


def inputs(lengths: list[int], device: torch.device) -> list[torch.Tensor]:
    """Two random sequences per length, the same for every case."""
    return [torch.randint(0, BASE["vocab_size"], (2, n), generator=torch.Generator().manual_seed(n)).to(device)
            for n in lengths]  # fmt: skip


def changes_nothing(model: GPT, fields: dict[str, Any], variant: dict[str, Any], device: torch.device) -> bool:
    """Whether the variant's options leave the reference's logits as they are (rope_scaling without RoPE)."""
    plain_fields = {k: v for k, v in fields.items() if k not in variant}
    try:
        plain = build(plain_fields, reference_name(fields["attention"]), device)
    except ConfigError:  # refused without the variant (a scheme a recurrent kind sets aside): it changes the model
        return False
    theirs, mine = plain.state_dict(), model.state_dict()
    if theirs.keys() != mine.keys() or any(theirs[k].shape != mine[k].shape for k in mine):
        return False  # other parameters: it changes the model
    plain.load_state_dict(mine)
    idx = inputs([QUICK_LENGTH], device)[0]
    with torch.no_grad():
        return torch.equal(plain.eval()(idx)[0], model.eval()(idx)[0])


def check_case(case: str, fields: dict[str, Any], names: list[str], variant: dict[str, Any] | None,
               cfg: CheckConfig, device: torch.device) -> list[Result]:  # fmt: skip
    """The rows of one case: for each kernel of `names` (one model, `GPT.switch`), forward (and backward)
    against the reference per dtype, the cache, the compiled model."""
    try:
        config = GPTConfig(**BASE, **fields)
    except ConfigError as error:
        return [Result(case, "all", skipped=f"refused: {error}")]
    reference = reference_name(fields["attention"])
    results, able = [], []
    for name in names:  # refused before any model is built
        try:
            able.append(dataclasses.replace(config, attn_backend=name))
        except ConfigError as error:
            results.append(Result(f"{case}/{name}", "all", skipped=f"refused: {error}"))
    if not able:
        return results
    model = build(fields, reference, device)
    if variant is not None and changes_nothing(model, fields, variant, device):
        return [Result(case, "all", skipped="changes nothing for this function and scheme")]
    longest = model.pe.max_positions
    idxs = inputs([n for n in ((QUICK_LENGTH,) if cfg.quick else LENGTHS) if longest is None or n <= longest], device)
    grad = not cfg.quick
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()  # what training runs on such a GPU
    expected = [run_model(model.train(grad), idx, torch.float32, grad) for idx in idxs]
    for candidate in able:
        name = candidate.attn_backend
        row = f"{case}/{name}"
        model.switch(candidate)
        if name != reference:
            for dtype in (torch.float32, torch.bfloat16) if bf16 else (torch.float32,):
                results += compare(row, model, idxs, expected, dtype, grad)
        if cfg.quick:
            continue
        started = time.perf_counter()
        try:
            results.append(judge(row, "cache", cache_error(model.eval(), CACHE_LENGTH), torch.float32, started))
        except KernelError as error:
            results.append(Result(row, "cache", skipped=str(error)))
        if cfg.compile:  # afresh for each case (past Dynamo's recompile limit it would run eagerly, unchecked),
            torch._dynamo.reset()  # at one length: a compile per case, not per length
            one = [i for i, idx in enumerate(idxs) if idx.size(-1) == COMPILED_LENGTH] or [0]
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                results += compare(row, torch.compile(model), [idxs[i] for i in one], [expected[i] for i in one],
                                   torch.float32, False, "compiled")  # fmt: skip
    return results


def compare(row: str, model: Any, idxs: list[torch.Tensor], expected: list, dtype: torch.dtype, grad: bool,
            check: str = "forward") -> list[Result]:  # fmt: skip
    """The forward (and with `grad` the backward) rows of `model` against `expected`, the largest error over
    the lengths; what the kernel cannot run here is skipped."""
    tag = "" if dtype == torch.float32 else f" [{str(dtype).removeprefix('torch.')}]"
    rows = []
    for with_grad in (False, True) if grad else (False,):
        started, worst, name = time.perf_counter(), 0.0, ("backward" if with_grad else check) + tag
        try:
            for idx, (ref_logits, ref_grads) in zip(idxs, expected, strict=True):
                logits, grads = run_model(model.train(with_grad), idx, dtype, with_grad)
                if with_grad:
                    floor = GRADIENT_FLOOR * max(g.abs().max().item() for g in ref_grads.values())
                    worst = max(worst, *(error_of(g, ref_grads[n], floor) for n, g in grads.items()))
                else:
                    worst = max(worst, error_of(logits, ref_logits))
        except KernelError as error:
            rows.append(Result(row, name, skipped=str(error)))
            break
        rows.append(judge(row, name, worst, dtype, started))
    return rows


def row_line(row: Result) -> str:
    if row.passed is None:
        return f"{row.case:58s} {row.check:17s} {'':>9s} {'':>7s} skip  {row.seconds:6.2f}s  {row.skipped}"
    verdict = "pass" if row.passed else "FAIL"
    return f"{row.case:58s} {row.check:17s} {row.error:9.2e} {row.tolerance:7.0e} {verdict:5s} {row.seconds:6.2f}s"


class CheckFailed(UserError):
    """Some kernel disagrees with the reference beyond its tolerance."""

    exit_code = 1


HEADER = f"{'case':58s} {'check':17s} {'max error':>9s} {'tol':>7s} pass  {'time':>7s}"


def skip_kind(reason: str) -> str:
    """What a skip's reason is about, without its settings: the config's refusals are one kind, a kernel's device
    another ('... cannot run this configuration: it lacks a forward pass on cpu'), an option that changes nothing a
    third."""
    if reason.startswith("refused: "):
        return "refused: combinations the config refuses, as train.py would"
    return re.sub(r"'[^']*'", "...", reason.split(" (")[0].split(". ")[0])


def main(cfg: CheckConfig) -> list[Result]:
    device = pick_device(cfg.device)
    if cfg.verbose:
        print(HEADER)
    live = not cfg.verbose and sys.stdout.isatty()  # a count in place on a terminal; a log gets the end only
    started, threads = time.perf_counter(), torch.get_num_threads()
    if device.type == "cpu":  # tiny shapes: threads only wait on each other (100x slower on a busy CPU)
        torch.set_num_threads(1)
    results: list[Result] = []
    try:
        for case, fields, variant in grid():  # the cases whose name holds cfg.only, each row printed when done
            names = [n for n in ATTENTIONS[fields["attention"]].kernels if not cfg.only or cfg.only in f"{case}/{n}"]
            if cfg.quick:  # no cache check: the reference alone has nothing to be compared with
                names = [n for n in names if n != reference_name(fields["attention"])]
            for row in check_case(case, fields, names, variant, cfg, device) if names else []:
                results.append(row)
                if cfg.verbose:
                    print(row_line(row), flush=True)
            if live and results:
                failing = sum(r.passed is False for r in results)
                print(f"\r{len(results)} rows, {failing} failed: {case}"[:100].ljust(100), end="", flush=True)
    finally:
        torch.set_num_threads(threads)
        if live:
            print("\r" + " " * 100 + "\r", end="", flush=True)
    ran = [r for r in results if r.passed is not None]
    failed = [r for r in ran if not r.passed]
    if not cfg.verbose:  # the failures in full, the skips folded by kind (--verbose: every row above)
        if failed:
            print("\n".join(["Failed:", HEADER, *map(row_line, failed)]))
        skipped = [r for r in results if r.passed is None]
        if skipped:  # by kind of reason, the most common first, each with its count and one example's case
            named = [skip_kind(r.skipped or "") for r in skipped]
            kinds, example = Counter(named), {kind: r.case for kind, r in zip(named[::-1], skipped[::-1], strict=True)}
            print(f"Skipped {len(skipped)} (--verbose lists each with its reason):")
            print("\n".join(f"  {count:5d}  {kind} (e.g. {example[kind]})" for kind, count in kinds.most_common()))
    worst = max((r.error / r.tolerance for r in ran if r.error is not None), default=0.0)
    line = (
        f"{len(ran) - len(failed)} of {len(ran)} checks passed, {len(failed)} failed, {len(results) - len(ran)} "
        f"skipped, on {device.type} with torch {torch.__version__} in {time.perf_counter() - started:.0f} s "
        f"(largest error {worst:.2g} of its tolerance)"
    )
    print(line)
    if cfg.json:
        payload = {"device": str(device), "torch": torch.__version__, "quick": cfg.quick, "compile": cfg.compile,
                   "summary": line, "cases": [dataclasses.asdict(r) for r in results]}  # fmt: skip
        try:
            atomic_write_bytes(Path(cfg.json), (json.dumps(payload, indent=1) + "\n").encode())
        except OSError as error:
            raise UserError(f"cannot write {cfg.json}: {error.strerror or error}.") from None
        print(f"wrote {cfg.json}")
    if failed:
        names = ", ".join(f"{r.case} {r.check}" for r in failed[:3]) + (", ..." if len(failed) > 3 else "")
        raise CheckFailed(f"{len(failed)} checks failed ({names}): a kernel disagrees with the float32 reference.")
    return results


COMMAND = Command(
    "posgpt check",
    CheckConfig,
    main,
    "Check every attention kernel this device runs against the float32 reference: run it first on a new GPU or a "
    "new torch. Every attention function, position scheme, mask, score and option, and the KV cache against a full "
    "forward pass. Prints a table and a summary; exits 1 when a check fails.",
    logs=False,
)
