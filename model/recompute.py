"""Parts of a pass formed again in the backward pass, with no graph kept from the forward pass: the dense kernels'
row blocks and the delta rule's segments.

`torch.utils.checkpoint` (non-reentrant) records each part's graph in the forward pass, its saved tensors dropped:
a node and a few small C++ objects per operation, kept until the backward pass. On a CPU, glibc serves those from
the large blocks the part has just freed, and each pinned block can no longer hold the next part's tensors: the
heap grew by about a block per part, stick-breaking's resident peak at 2,048 tokens 14x RoPE's (issue 62). Here a
part runs without a graph, recording which tensors needing gradients it reads (a `TorchFunctionMode`); one node per
part forms it again in the backward pass and returns their gradients. Compiled, `checkpoint`: the compiler plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states


class _Reads(TorchFunctionMode):
    """Records the tensors needing gradients that torch functions are given: under `no_grad`, those a part reads from
    outside (arguments, parameters, what its closures hold), as what it forms needs none; given `stand_ins` (by the
    id of what was read), passes those instead."""

    def __init__(self, stand_ins: dict[int, Tensor] | None = None) -> None:
        super().__init__()
        self.tensors: dict[int, Tensor] = {}
        self.stand_ins = stand_ins

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.stand_ins is not None:
            return func(*map(self.swap, args), **{key: self.swap(a) for key, a in kwargs.items()})
        for given in (*args, *kwargs.values()):
            for t in given if isinstance(given, list | tuple) else (given,):  # torch.cat's list
                if isinstance(t, Tensor) and t.requires_grad:
                    self.tensors.setdefault(id(t), t)
        return func(*args, **kwargs)

    def swap(self, given: Any) -> Any:
        """The stand-in of a tensor that was read, in a list or tuple too, or what was given."""
        if isinstance(given, list | tuple):
            swapped = [self.swap(t) for t in given]
            return given if all(a is b for a, b in zip(swapped, given, strict=True)) else type(given)(swapped)
        return self.stand_ins.get(id(given), given) if self.stand_ins and isinstance(given, Tensor) else given


class _Recomputed(torch.autograd.Function):
    """One node for a part formed without a graph (`formed`). Its backward pass forms it again, with the first pass's
    random states and autocast (`state`), from detached stand-ins of its tensor arguments and of the tensors its
    closures hold that it read, so that the graph ends there (a parameter read by every layer would otherwise pull
    the layers below into this part's gradient), and returns their gradients. The arguments are saved tensors, not
    references: an enclosing checkpoint (`activation_checkpointing`) still drops them."""

    @staticmethod
    def forward(ctx: Any, part: Callable, args: tuple, formed: list, state: tuple, *tensors: Tensor) -> Any:
        ctx.part, (ctx.seeds, ctx.autocast) = part, state  # tensors: the tensor arguments, then what closures hold
        ctx.args = [None if isinstance(a, Tensor) else a for a in args]  # the tensor ones: saved
        ctx.given = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.held = [id(t) for t in tensors[len(ctx.given) :]]  # alive in the part's closures
        ctx.save_for_backward(*tensors)  # (unchanged until the backward pass: autograd checks their versions)
        return formed.pop()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        stand_ins = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        args = list(ctx.args)
        for i, tensor in zip(ctx.given, stand_ins, strict=False):
            args[i] = tensor
        held = dict(zip(ctx.held, stand_ins[len(ctx.given) :], strict=True))
        with torch.random.fork_rng(ctx.seeds[1] if ctx.seeds else [], enabled=ctx.seeds is not None):
            if ctx.seeds is not None:
                torch.set_rng_state(ctx.seeds[0])
                set_device_states(*ctx.seeds[1:])
            with contextlib.ExitStack() as autocast:  # as the first pass ran: bf16 matmuls formed in bf16
                for device, dtype in ctx.autocast:
                    autocast.enter_context(torch.autocast(device, dtype))
                with torch.enable_grad(), _Reads(held) if held else contextlib.nullcontext():
                    outputs = pytree.tree_leaves(ctx.part(*args))
        pairs = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if out.requires_grad]
        wanted = [t for t in stand_ins if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if pairs and wanted else ())  # fmt: skip
        return None, None, None, None, *(next(got, None) if t.requires_grad else None for t in stand_ins)


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
    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    return _Recomputed.apply(part, args, [formed], (seeds, autocast), *tensors, *held)
