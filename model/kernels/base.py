"""What an attention kernel is: a class that declares what it can run (class attributes, and `rank` for
`auto`, which `Attention.choose_kernel` reads), builds its context for a forward pass once for every layer
(`context`) and runs it (`run`).

Shapes: B batch, H heads, Tq / Tk query / key lengths, D head size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from posgpt.core.errors import UserError
from posgpt.model.terms import TERMS, Term

if TYPE_CHECKING:
    from posgpt.model.cache import CacheWrite
    from posgpt.model.masks import AttentionMask
    from posgpt.model.scores import Score
    from posgpt.model.terms import ScoreBias, TokenTerms

AUTO = "auto"
"""The `attn_backend` that lets `choose_kernel` pick (any other value names a kernel)."""

WeightsHook = Callable[[slice, Tensor], None]
"""Receives attention weights as a reference kernel forms them: (query rows, (B, H, rows, Tk)
float32 weights)."""

WEIGHTS_CHUNK_ELEMENTS = 1 << 24
"""Largest (B, H, rows, Tk) block of weights handed to a `WeightsHook` at once (64 MiB in float32)."""


class KernelError(UserError, RuntimeError):
    """A kernel asked for by name that cannot run what the model needs here, or no kernel at all that can."""


@dataclass(frozen=True)
class Placement:
    """Where the queries and keys of one forward pass sit. Without a cache: Tq tokens attending to each
    other at 0..Tq-1, or at `positions` (B, Tq) for the scheme only (the mask stays on token order).
    Decoding (`k_pos` given): queries at `positions` (B, Tq), keys at `k_pos` (B, Tk), -1 an empty slot."""

    q_len: int
    n_head: int
    device: torch.device
    positions: Tensor | None = None
    k_pos: Tensor | None = None
    rotation: Tensor | None = None
    """The scheme's `rotation` at the queries' positions, taken once (None: nothing, or `rotate` takes it)."""


class Lack(NamedTuple):
    """One need a kernel cannot meet: in words, and the model setting that asks for it (None: the device)."""

    words: str
    setting: str | None


@dataclass(frozen=True)
class Needs:
    """What one forward pass asks of a kernel."""

    terms: frozenset[Term] = frozenset()
    """What is done to the scores (`model.terms`)."""
    term_gradients: bool = False
    """Gradients through learned terms (a learned bias, FoX's gates)."""
    dropout: bool = False
    backward_on: str | None = None
    runs_on: str | None = None
    """The device of the forward pass (None: any, as a config's validation asks)."""
    decoding: bool = False
    dot_score: bool = True
    """The score is a scaled dot product (`Score.dot_product`)."""
    head_size: int | None = None
    """The head size the kernel sees (the model's; half of it for differential attention); None: any."""
    float64: bool = False
    """The kernel computes in float64 (float64 weights, no autocast)."""
    window_only: bool = False
    """The mask beyond causal is a window alone (no sinks, random blocks or chunks)."""
    table_gradients: bool = False
    """Gradients into a scheme's learned bias (T5's, Kerple's, FIRE's): flex's backward adds every pair's into it."""

    def unmet(self, kernel: Kernel) -> list[Lack]:
        terms = self.terms - ({Term.MASK} if self.window_only and kernel.windows else set())
        missing = [Lack(*term.value) for term in TERMS if term in terms and term not in kernel.terms]
        if self.decoding and not kernel.decodes:
            missing.append(Lack("decoding through a KV cache", None))
        if self.term_gradients and not kernel.term_gradients:
            missing.append(Lack("gradients through learned score terms", "pos_encoding"))
        if self.dropout and not kernel.dropout:
            missing.append(Lack("attention dropout", "dropout"))
        if self.runs_on and kernel.devices is not None and self.runs_on not in kernel.devices:
            why = kernel.device_notes.get(self.runs_on)
            missing.append(Lack(f"a forward pass on {self.runs_on}" + (f" ({why})" if why else ""), None))
        if self.backward_on and kernel.backward_devices is not None and self.backward_on not in kernel.backward_devices:
            missing.append(Lack(f"a backward pass on {self.backward_on}", None))
        if not self.dot_score and not kernel.any_score:
            missing.append(Lack("a score other than a scaled dot product", "attn_score"))
        if self.float64 and self.runs_on in kernel.no_float64_on:
            missing.append(Lack(f"float64 on {self.runs_on} ({kernel.no_float64_on[self.runs_on]})", None))
        if kernel.max_head_size and self.head_size is not None and self.head_size > kernel.max_head_size:
            missing.append(Lack(f"heads over {kernel.max_head_size} wide (here {self.head_size})", "n_embd"))
        least = kernel.min_head_size.get(self.runs_on or "", 0)
        if self.head_size is not None and self.head_size < least:
            words = f"heads under {least} wide on {self.runs_on} (here {self.head_size}, from n_embd / n_head)"
            missing.append(Lack(words, "n_embd"))
        return missing


class Kernel:
    """An attention kernel: its declared capabilities, its context, its run (see the module docstring)."""

    terms: frozenset[Term] = frozenset()
    """What it does to the scores on request (`model.terms`), in the order `model.terms` gives."""
    term_gradients: bool = False
    """Carries gradients through learned terms."""
    dropout: bool = False
    devices: frozenset[str] | None = None
    """Devices it runs on at all (None: every device)."""
    device_notes: Mapping[str, str] = {}
    """Why it does not run on a device where one might expect it to, by device type: said in the refusal."""
    backward_devices: frozenset[str] | None = None
    """Devices with a backward pass (None: every device)."""
    min_head_size: Mapping[str, int] = {}
    """The smallest head size it runs, by device type (absent: any)."""
    no_float64_on: Mapping[str, str] = {}
    """Device types where it has no float64 kernel, with the reason said in the refusal."""
    auto_devices: frozenset[str] | None = None
    """Devices where `auto` may pick it (None: every device)."""
    weights: bool = False
    """Forms the attention weights, handing them to `on_weights` (the reference path of its function)."""
    any_score: bool = False
    """Runs any scoring function, not only a scaled dot product."""
    grouped_kv: bool = False
    """Takes fewer key/value heads than query heads itself (grouped-query attention; `Plan.attend` repeats them for
    the others)."""
    decodes: bool = True
    """Attends new queries over a KV cache's keys (decoding); one that does not, named, leaves decoding to `auto`."""
    max_head_size: int | None = None
    """The widest head it runs (None: any)."""
    windows: bool = False
    """Runs a window alone as its mask without declaring `Term.MASK` (fla's `window_size`)."""

    def rank(self, needs: Needs, device: torch.device) -> float:
        """Preference of `auto` among the kernels that can run `needs` on `device`: lowest first. A reference, which
        forms the weights, runs only when no fused kernel can."""
        return 2.0 if self.weights else 1.0

    def context(
        self, bias: ScoreBias | None, mask: AttentionMask, placement: Placement, memo: dict, **settings: Any
    ) -> Any:
        """What a layer's call of this kernel needs for one forward pass (None: nothing): the position terms `bias`
        and the `mask` made ready; `settings`: the attention function's own options (`Attention.kernel_settings`)."""
        return None

    def run(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, score: Score, dropout_p: float) -> Tensor:
        """The (B, H, Tq, D) output for (B, H, Tq, D) queries and (B, H, Tk, D) keys and values, by `plan`: its
        context, the layer's own terms and who receives the weights."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Plan:
    """One forward pass's attention: the kernel, its context, where the tokens sit and who receives the
    weights; shared by every layer, or a copy per layer (attention maps, a bias per layer, a layer's own terms)."""

    kernel: Kernel
    context: Any
    placement: Placement
    on_weights: WeightsHook | None = None
    cache_write: CacheWrite | None = None
    """Decoding: where the new tokens go in the cache (`model.cache`)."""
    tokens: TokenTerms | None = None
    """The layer's own terms, set by the layer that attends: `Term.TOKENS`, ..."""
    transform: Callable[[Tensor], Tensor] | None = None
    """... `Term.TRANSFORM`, a pointwise function of the scores, ..."""
    sinks: Tensor | None = None
    """... and `Term.MASS`, (H,) float32 logits: one keyless term per head in the softmax's normaliser."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, score: Score, dropout_p: float) -> Tensor:
        """The (B, H, Tq, D) output of queries q (B, H, Tq, D) over keys and values (B, H_kv, Tk, D): query head h
        reads key/value head h // (H / H_kv)."""
        # a layer's own terms its kernel lacks: undeclared (`Attention.terms`), no kernel could refuse them when chosen
        carried = {Term.TOKENS: self.tokens, Term.TRANSFORM: self.transform, Term.MASS: self.sinks}
        undeclared = [t.value[0] for t, held in carried.items() if held is not None and t not in self.kernel.terms]
        if undeclared:
            raise KernelError(f"{self.kernel!r} lacks {', '.join(undeclared)}: declare them in the layer's terms")
        if k.size(1) != q.size(1) and not self.kernel.grouped_kv:
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        return self.kernel.run(q, k, v, self, score, dropout_p)
