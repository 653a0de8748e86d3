"""Parts of a pass formed again in the backward pass, with no graph kept from the forward pass: the dense kernels'
row blocks and the delta rule's segments.

`torch.utils.checkpoint` (non-reentrant) records each part's graph in the forward pass, its saved tensors dropped:
one node and a few small C++ objects per operation, kept until the backward pass. On a CPU, glibc serves those small
objects from the large blocks the part has just freed, and each pinned block can no longer hold the next part's
tensors, so the heap grows by about a block's tensors per part: stick-breaking's resident peak at 2,048 tokens was
14x RoPE's, with 1.3x its saved bytes (issue 62). Here a part runs without a graph, recording which tensors it reads
that need gradients (a `TorchFunctionMode`); one node per part forms it again in the backward pass and returns the
gradients of those tensors. Inside a compiled graph the compiler plans the memory: `checkpoint` there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint


class _Reads(TorchFunctionMode):
    """Records the tensors needing gradients that any torch function is given: under `no_grad`, those a part reads
    from outside (its inputs, parameters, and tensors its closures hold), as what it forms needs none. Given
    `stand_ins` (by the id of what was read), gives the functions those instead."""

    def __init__(self, stand_ins: dict[int, Tensor] | None = None) -> None:
        super().__init__()
        self.tensors: dict[int, Tensor] = {}
        self.stand_ins = stand_ins

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.stand_ins is not None:  # torch.cat's list: one level down
            args = tuple(self.swap(a) for a in args)
            kwargs = {key: self.swap(a) for key, a in kwargs.items()}
        else:
            for given in (*args, *kwargs.values()):
                for t in given if isinstance(given, list | tuple) else (given,):
                    if isinstance(t, Tensor) and t.requires_grad:
                        self.tensors.setdefault(id(t), t)
        return func(*args, **kwargs)

    def swap(self, given: Any) -> Any:
        """The stand-in of a tensor that was read, in a list or tuple too (torch.cat's), or what was given."""
        if isinstance(given, list | tuple):
            swapped = [self.swap(t) for t in given]
            return given if all(a is b for a, b in zip(swapped, given, strict=True)) else type(given)(swapped)
        return self.stand_ins.get(id(given), given) if self.stand_ins and isinstance(given, Tensor) else given


class _Value(NamedTuple):
    """A non-tensor argument of a part (None among them too), apart from the tensor ones, which are saved."""

    value: Any


class _Recomputed(torch.autograd.Function):
    """One node for a part formed without a graph (`formed`): its backward pass forms it again with one, seeded as
    the first time, from detached stand-ins of its tensor arguments and of the tensors its closures hold that it read
    (`held`), so that the graph ends there (a parameter read by every layer would otherwise pull the layers below
    into this part's gradient), and returns their gradients. The arguments are saved tensors, not references: an
    enclosing checkpoint (`activation_checkpointing`) still drops them."""

    @staticmethod
    def forward(ctx: Any, part: Callable, args: list, formed: list, seeds: tuple | None, *tensors: Tensor) -> Any:
        ctx.part, ctx.args, ctx.seeds = part, args, seeds  # args: the non-tensor ones; tensors: then the held ones
        ctx.held = [id(t) for t in tensors[sum(a is None for a in args) :]]  # alive in the part's closures
        ctx.save_for_backward(*tensors)  # (unchanged until the backward pass: autograd checks their versions)
        return formed.pop()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        stand_ins = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        given = iter(stand_ins)
        args = [next(given) if a is None else a.value for a in ctx.args]
        with torch.random.fork_rng(devices=[] if ctx.seeds is None else ctx.seeds[1], enabled=ctx.seeds is not None):
            if ctx.seeds is not None:
                _seed(ctx.seeds)
            held = dict(zip(ctx.held, given, strict=True))
            with torch.enable_grad(), _Reads(held) if held else contextlib.nullcontext():
                outputs = pytree.tree_leaves(ctx.part(*args))
        pairs = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if out.requires_grad]
        wanted = [t for t in stand_ins if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if pairs and wanted else ())  # fmt: skip
        return None, None, None, None, *(next(got, None) if t.requires_grad else None for t in stand_ins)


def _seeds(args: tuple) -> tuple:
    """The random states a part with dropout draws from: the CPU's, and the CUDA devices' its tensors are on."""
    devices = sorted({t.device.index for t in pytree.tree_leaves(args) if isinstance(t, Tensor) and t.is_cuda})
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


def _seed(seeds: tuple) -> None:
    cpu, devices, states = seeds
    torch.set_rng_state(cpu)
    for device, state in zip(devices, states, strict=True):
        torch.cuda.set_rng_state(state, device)


def recomputed(part: Callable[..., Any], *args: Any, random: bool = False) -> Any:
    """`part(*args)`, a tensor or a tuple of them, formed again in the backward pass (`random`: it draws random
    numbers, dropout's, the same both times)."""
    if torch.compiler.is_compiling():
        return checkpoint(part, *args, use_reentrant=False, preserve_rng_state=random)
    seeds, reads = (_seeds(args) if random else None), _Reads()
    with torch.no_grad(), reads:
        formed = part(*args)
    tensors = [a for a in args if isinstance(a, Tensor)]
    held = [t for t in reads.tensors.values() if not any(t is a for a in tensors)]
    kept = [None if isinstance(a, Tensor) else _Value(a) for a in args]
    return _Recomputed.apply(part, kept, [formed], seeds, *tensors, *held)
