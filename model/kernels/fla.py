"""flash-linear-attention's fused Triton kernels (`fla-core`, MIT; `pip install 'posgpt[fla]'`) behind forgetting
attention (`fla.ops.attn.parallel`, the kernel of `parallel_forgetting_attn`), stick-breaking attention
(`fla.ops.stickbreaking_attn.parallel`), Gated DeltaNet (`chunk_gated_delta_rule`) and KDA (`chunk_kda`):
`attn_backend: fla`, picked by `auto` on CUDA where fla is installed.

Each is a custom op (`torch.library`) whose backward is fla's own, an op too, so a compiled model keeps one graph
around it (fla wraps its own entry points in `torch.compiler.disable`); the delta rule's backward runs fla's forward
again first (its public autograd function: no internals of the chunk kernels are called). fla is imported inside
the ops, never where it is absent. Its kernels run on CUDA, and on a CPU only under Triton's interpreter
(`TRITON_INTERPRET=1`, which the tests use); no float64, no dropout, no decoding (the functions' own cached step runs
there), and of the masks a window alone (forgetting attention's `window_size`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import math
import os
from typing import Any

import torch
from torch import Tensor

from posgpt.model.kernels.base import Kernel, Placement, Plan
from posgpt.model.masks import AttentionMask
from posgpt.model.scores import Score
from posgpt.model.terms import ScoreBias, Term

FLA_VERSION = "0.6.0"
"""The fla-core whose internals (`parallel_attn_fwd`, ...) these ops call."""
LOG2_E = 1 / math.log(2)
"""fla's softmax runs on exp2: its forget-gate sums come in log2 units."""
INSTALL = f"needs fla-core {FLA_VERSION}: pip install 'posgpt[fla]'"


def on_device(t: Tensor) -> contextlib.AbstractContextManager:
    """t's CUDA device made current for fla's launches (fla's own entry points do so, its internals do not)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("posgpt::fla_forgetting", mutates_args=())
def fla_forgetting(q: Tensor, k: Tensor, v: Tensor, c: Tensor, scale: float, window: int) -> tuple[Tensor, Tensor]:
    """Forgetting attention of (B, T, H, D) q, k, v with the forget-gate sums c (B, T, H) (natural log), keys within
    `window` (0: all): the output and fla's log-sum-exp (kept for the backward)."""
    from fla.ops.attn.parallel import parallel_attn_fwd

    with on_device(q):
        o, lse = parallel_attn_fwd(q, k, v, c * LOG2_E, None, scale, window or None)
    return o.to(q.dtype), lse


@fla_forgetting.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, c: Tensor, scale: float, window: int) -> tuple[Tensor, Tensor]:
    return q.new_empty(*q.shape[:3], v.size(-1)), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("posgpt::fla_forgetting_backward", mutates_args=())
def fla_forgetting_backward(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, c: Tensor, lse: Tensor, do: Tensor, scale: float, window: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fla's backward of `fla_forgetting`: the gradients of q, k, v and c (an op too, so that a compiled graph
    holds it whole)."""
    from fla.ops.attn.parallel import parallel_attn_bwd

    with on_device(q):
        dq, dk, dv, dc, _ = parallel_attn_bwd(q, k, v, o, c * LOG2_E, lse, do.contiguous(), None, scale, window or None)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dc


@fla_forgetting_backward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, o: Tensor, c: Tensor, lse: Tensor, do: Tensor, scale: float,
      window: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(c)


def _forgetting_backward(ctx: Any, do: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    return *fla_forgetting_backward(*ctx.saved_tensors, do, ctx.scale, ctx.window), None, None


def _forgetting_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, c, ctx.scale, ctx.window = inputs
    ctx.save_for_backward(q, k, v, output[0], c, output[1])


fla_forgetting.register_autograd(_forgetting_backward, setup_context=_forgetting_context)


@torch.library.custom_op("posgpt::fla_stick_breaking", mutates_args=())
def fla_stick_breaking(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Stick-breaking attention of (B, T, H, D) q, k, v, each query over the keys before it: the output and the
    stick no key takes, (B, T, H)."""
    from fla.ops.stickbreaking_attn.parallel import parallel_stickbreaking_attn_fwd

    with on_device(q):
        o, rest = parallel_stickbreaking_attn_fwd(q, k, v, scale, False)
    return o.to(q.dtype), rest


@fla_stick_breaking.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty(*q.shape[:3], v.size(-1)), q.new_empty(q.shape[:3])


@torch.library.custom_op("posgpt::fla_stick_breaking_backward", mutates_args=())
def fla_stick_breaking_backward(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, drest: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """fla's backward of `fla_stick_breaking`: the gradients of q, k and v."""
    from fla.ops.stickbreaking_attn.parallel import parallel_stickbreaking_attn_bwd

    with on_device(q):
        dq, dk, dv = parallel_stickbreaking_attn_bwd(q, k, v, do.contiguous(), drest.contiguous(), scale, False)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@fla_stick_breaking_backward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, do: Tensor, drest: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _stick_breaking_backward(ctx: Any, do: Tensor, drest: Tensor) -> tuple[Tensor | None, ...]:
    return *fla_stick_breaking_backward(*ctx.saved_tensors, do, drest, ctx.scale), None


def _stick_breaking_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, ctx.scale = inputs
    ctx.save_for_backward(q, k, v)


fla_stick_breaking.register_autograd(_stick_breaking_backward, setup_context=_stick_breaking_context)


def _delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """fla's chunk kernel of the gated delta rule: Gated DeltaNet's for one decay per head (g (B, T, H)), KDA's for
    one per key channel (g (B, T, H, d_k)); q already scaled."""
    if g.dim() == 3:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as rule
    else:
        from fla.ops.kda import chunk_kda as rule
    out, final = rule(q, k, v, g, beta, scale=1.0, initial_state=state, output_final_state=True)
    return out.to(v.dtype), final


@torch.library.custom_op("posgpt::fla_delta_rule", mutates_args=())
def fla_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule over (B, T, H, d) q, k, v and (B, T, H) beta from `state` (B, H, d_k, d_v; None: zeros):
    the outputs and the final state."""
    return _delta_rule(q, k, v, beta, g, state)


@fla_delta_rule.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    B, T, H, d_k = k.shape
    return torch.empty_like(v), k.new_empty(B, H, d_k, v.size(-1), dtype=torch.float32)


@torch.library.custom_op("posgpt::fla_delta_rule_backward", mutates_args=())
def fla_delta_rule_backward(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None, dout: Tensor, dfinal: Tensor
) -> list[Tensor]:
    """The gradients of `fla_delta_rule`'s inputs (and of `state` where given), through fla's own backward after its
    forward is run again (fla's chunk kernels recompute their chunks' blocks in the backward pass too)."""
    given = [t.detach().requires_grad_() for t in (q, k, v, beta, g, *([state] if state is not None else []))]
    with torch.enable_grad():
        out, final = _delta_rule(*given[:5], given[5] if state is not None else None)
        return list(torch.autograd.grad((out, final), given, (dout, dfinal)))


@fla_delta_rule_backward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None, dout: Tensor,
      dfinal: Tensor) -> list[Tensor]:  # fmt: skip
    return [torch.empty_like(t) for t in (q, k, v, beta, g, *([state] if state is not None else []))]


def _delta_backward(ctx: Any, dout: Tensor, dfinal: Tensor) -> tuple[Tensor | None, ...]:
    grads = fla_delta_rule_backward(*ctx.saved_tensors[:5], ctx.state, dout, dfinal)  # unused outputs': zeros
    return (*grads[:5], grads[5] if ctx.state is not None else None)


def _delta_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.state = inputs[5]


fla_delta_rule.register_autograd(_delta_backward, setup_context=_delta_context)


@functools.cache  # read once a process: every kernel choice asks
def fla_installed() -> bool:
    """Whether the fla-core these ops were written for is installed."""
    try:
        return importlib.util.find_spec("fla") is not None and importlib.metadata.version("fla-core") == FLA_VERSION
    except importlib.metadata.PackageNotFoundError:  # fla from another distribution
        return False


def fla_runs_on() -> frozenset[str]:
    """Where fla's kernels run here: CUDA, and the CPU under Triton's interpreter; nowhere without fla."""
    if not fla_installed():
        return frozenset()
    return frozenset({"cuda", "cpu"}) if os.environ.get("TRITON_INTERPRET") == "1" else frozenset({"cuda"})


class FlaKernel(Kernel):
    """fla's fused kernel of one attention function (`fused`), on (B, T, H, D) tensors: no bias, no dropout, no
    decoding, no float64."""

    term_gradients = True
    decodes = False
    max_head_size = 256  # fla's kernels hold a head's keys in one block
    auto_devices = frozenset({"cuda"})
    no_float64_on = {"cuda": "fla's Triton kernels have no float64", "cpu": "fla's Triton kernels have no float64"}

    @property
    def devices(self) -> frozenset[str]:  # type: ignore[override]
        return fla_runs_on()

    @property
    def backward_devices(self) -> frozenset[str]:  # type: ignore[override]
        return fla_runs_on()

    @property
    def device_notes(self) -> dict[str, str]:  # type: ignore[override]
        if not fla_installed():
            return {"cuda": INSTALL, "cpu": INSTALL}
        return {"cpu": "fla's Triton kernels run on a CPU only under TRITON_INTERPRET=1"}

    def rank(self, needs: Any, device: torch.device) -> float:
        return -1.0  # fused for this function alone: first wherever it can run

    def context(
        self, bias: ScoreBias | None, mask: AttentionMask, placement: Placement, memo: dict, **settings: Any
    ) -> Any:
        return mask.window, settings

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        scale = score.scale if score.scale is not None else q.size(-1) ** -0.5
        window, settings = plan.context
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return self.fused(q, k, v, plan, scale, window, **settings).transpose(1, 2)

    def fused(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, scale: float, window: int, **settings: Any) -> Tensor:
        raise NotImplementedError


class FlaForgetting(FlaKernel):
    """Forgetting attention on fla's kernel (its `parallel_forgetting_attn`), a window as its `window_size`."""

    terms = frozenset({Term.TOKENS})
    windows = True

    def fused(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, scale: float, window: int, **settings: Any) -> Tensor:
        assert plan.tokens is not None  # the layer's forget-gate sums: the same for queries and keys here
        c = plan.tokens.q.transpose(1, 2).contiguous()
        return fla_forgetting(q, k, v, c, scale, window)[0]


class FlaStickBreaking(FlaKernel):
    """flash-linear-attention's fused Triton kernels (`pip install 'posgpt[fla]'`), first for `auto` on CUDA: for
    stick-breaking its `parallel_stickbreaking_attn` (what no key takes goes to the query's own value with
    `sb_remainder: current`), for forgetting attention its `parallel_forgetting_attn` (a window as its
    `window_size`), for Gated DeltaNet and KDA their chunk kernels; no position bias, dropout, decoding or float64
    (today's kernels run those)."""

    def fused(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, scale: float, window: int, **settings: Any) -> Tensor:
        out, rest = fla_stick_breaking(q, k, v, scale)
        return out + rest[..., None].to(v.dtype) * v if settings["remainder"] else out


class FlaDelta(FlaKernel):
    """Gated DeltaNet's and KDA's chunk kernels from fla (`chunk_gated_delta_rule`, `chunk_kda`) as the delta rule's
    `rule`, the state in float32; the backward runs fla's after its forward again."""

    @staticmethod
    def rule(
        q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        q, k, v, beta = (t.transpose(1, 2).contiguous() for t in (q, k, v, beta))
        g = g.transpose(1, 2)
        out, final = fla_delta_rule(q, k, v, beta, (g[..., 0] if g.size(-1) == 1 else g).contiguous(), state)
        return out.transpose(1, 2), final
