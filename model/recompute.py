"""Parts of a pass formed again in the backward pass with no graph kept from the forward pass: the dense kernels' row
blocks and the delta rule's segments. `torch.utils.checkpoint` records a node and a few small C++ objects per
operation until the backward pass; on a CPU glibc serves those from the blocks just freed, which then no longer hold
the next block: the heap grew by a block per block (stick-breaking 14x RoPE's resident peak at 2,048 tokens, issue
62). Here a part runs without a graph, a `TorchFunctionMode` recording what it reads that needs gradients, and one
node forms it again in the backward pass. Compiled, `checkpoint`: the compiler plans the memory there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states


class _Reads(TorchFunctionMode):
    """Records the tensors needing gradients that torch functions are given (under `no_grad`: what a part reads from
    outside, arguments, parameters, what closures hold); given `stand_ins` (by the id of what was read), swaps them."""

    def __init__(self, stand_ins: dict[int, Tensor] | None = None) -> None:
        super().__init__()
        self.tensors: dict[int, Tensor] = {}
        self.stand_ins = stand_ins

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.stand_ins:  # (one inside a list is not swapped: `_ends_at` refuses what that loses)
            swap = self.stand_ins.get
            args, kwargs = tuple([swap(id(a), a) for a in args]), {k: swap(id(a), a) for k, a in kwargs.items()}
        elif self.stand_ins is None:
            self.tensors |= {id(t): t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.requires_grad}
        return func(*args, **kwargs)


class _Recomputed(torch.autograd.Function):
    """One node for a part formed without a graph (`formed`), formed again in its backward pass (random states and
    autocast as the first time) from detached stand-ins of the tensors it read (its arguments, saved, and what its
    closures hold), so that its graph ends there: a parameter read by every layer would pull in the layers below."""

    @staticmethod
    def forward(ctx: Any, part: Callable, args: tuple, formed: list, state: tuple, *tensors: Tensor) -> Any:
        ctx.part, (ctx.seeds, ctx.autocast) = part, state  # tensors: the tensor arguments, then what closures hold
        ctx.args = [None if isinstance(a, Tensor) else a for a in args]  # tensors saved (a checkpoint drops them)
        ctx.given = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.held = [id(t) for t in tensors[len(ctx.given) :]]  # alive in the part's closures
        ctx.save_for_backward(*tensors)  # (unchanged until the backward pass: autograd checks their versions)
        return formed.pop()

    @staticmethod
    @once_differentiable  # (its gradient's own graph is not kept: a second derivative raises)
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        stand_ins = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        args = [stand_ins[ctx.given.index(i)] if i in ctx.given else a for i, a in enumerate(ctx.args)]
        held = dict(zip(ctx.held, stand_ins[len(ctx.given) :], strict=True))
        with torch.random.fork_rng(ctx.seeds[1] if ctx.seeds else [], enabled=ctx.seeds is not None):
            if ctx.seeds is not None:
                torch.set_rng_state(ctx.seeds[0])
                set_device_states(*ctx.seeds[1:])
            with contextlib.ExitStack() as autocast, torch.enable_grad():  # autocast as the first pass ran
                for device, enabled, dtype in ctx.autocast:
                    if enabled or torch.is_autocast_enabled(device):
                        autocast.enter_context(torch.autocast(device, dtype, enabled=enabled))
                autocast.enter_context(_Reads(held) if held else contextlib.nullcontext())
                outputs = pytree.tree_leaves(ctx.part(*args))
        _ends_at(outputs, stand_ins)
        pairs = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if out.requires_grad]
        wanted = [t for t in stand_ins if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if pairs and wanted else ())  # fmt: skip
        return None, None, None, None, *(next(got, None) if t.requires_grad else None for t in stand_ins)


def _ends_at(outputs: list[Tensor], stand_ins: list[Tensor]) -> None:
    """Refuses a graph formed again that reaches beyond the stand-ins (a read unseen by the mode): a lost gradient."""
    nodes, seen = [o.grad_fn for o in outputs if o.grad_fn is not None], set()
    while nodes:
        if (node := nodes.pop()) in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable") and not any(node.variable is t for t in stand_ins):
            raise RuntimeError(f"model/recompute.py: a part read a {tuple(node.variable.shape)} tensor needing "
                               "gradients unseen: pass it through a torch function first")  # fmt: skip
        nodes += [n for n, _ in node.next_functions if n is not None]


def recomputed(part: Callable[..., Any], *args: Any, random: bool = False) -> Any:
    """`part(*args)`, a tensor or a tuple of them, formed again in the backward pass (`random`: it draws random
    numbers, dropout's, the same both times)."""
    if torch.compiler.is_compiling():
        return checkpoint(part, *args, use_reentrant=False, preserve_rng_state=random)
    seeds, reads = ((torch.get_rng_state(), *get_device_states(*args)) if random else None), _Reads()
    with torch.no_grad(), reads:
        formed = part(*args)
    tensors = [a for a in args if isinstance(a, Tensor)]
    held = [t for t in reads.tensors.values() if not any(t is a for a in tensors)]
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
    return _Recomputed.apply(part, args, [formed], (seeds, autocast), *tensors, *held)
