"""The attention kernels and their registry: eager (the reference), SDPA, FlexAttention, and
linear attention's two forms.

Shapes: B batch, H heads, Tq / Tk query / key lengths, D head size.

A kernel is one `KERNELS` entry that declares what it can run (the attention function, a score
bias, gradients through a learned bias, attention dropout, the devices with a backward pass, masks
beyond causal, scoring functions, returning the weights). `attn_backend="auto"` picks the first
kernel of the device's preference order whose declarations cover what the model needs
(`choose_kernel`):

| needs                                                   | CUDA                                  | CPU / other |
|---------------------------------------------------------|---------------------------------------|-------------|
| nothing beyond causal (learned, sinusoidal, rope, none) | sdpa, is_causal=True (FlashAttention) | sdpa        |
| a score bias (alibi, t5) or a window mask               | flex (bias, block sparsity in-kernel) | sdpa        |
| the same, with attention dropout or when decoding       | sdpa (no dropout in flex; no per-length compile) | sdpa |
| the additive score                                      | eager (chunked over queries)          | eager       |
| linear attention                                        | chunked                               | chunked     |

`auto` never picks flex off CUDA: in torch 2.13 FlexAttention has no CPU backward pass and
compiles for ~15 s per new shape there, while SDPA's CPU kernels are fast enough. An explicit
kernel that cannot run a configuration fails with a message naming what is missing and which
kernels can.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from model.linear_attention import (
    WEIGHTS_CHUNK_ELEMENTS,
    WeightsHook,
    linear_attention_chunked,
    linear_attention_quadratic,
)
from model.masks import AttentionMask
from model.positions import PositionEncoding
from model.scores import ScaledDot, Score

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class AttentionContext:
    """What every layer's attention needs for one forward pass, built once by `GPT`.

    For eager and SDPA: `mask` is the dense (Tq, Tk) visibility (None when SDPA can use its own
    causal shortcut) and `bias` the scheme's (H, Tq, Tk) score bias with -inf where a key is not
    visible (None without a bias). For flex: `block_mask` and `score_mod`.
    """

    kernel: Kernel
    q_start: int
    q_len: int
    k_len: int
    mask: Tensor | None = None
    bias: Tensor | None = None
    block_mask: BlockMask | None = None
    score_mod: ScoreMod | None = None
    on_weights: WeightsHook | None = None
    ids: Tensor | None = None
    """Each row's own positions (B, T), when not contiguous (randomized positions); then `bias` is
    (B, H, Tq, Tk)."""


@dataclass(frozen=True)
class Needs:
    """What one forward pass asks of a kernel."""

    function: str = "softmax"
    """The attention function: softmax or linear (`GPTConfig.attention`)."""
    score_bias: bool = False
    bias_gradients: bool = False
    dropout: bool = False
    backward_on: str | None = None
    sparse_mask: bool = False
    decoding: bool = False
    score: str = "scaled_dot"

    def unmet(self, kernel: Kernel) -> list[str]:
        """What `kernel` cannot do of these needs, in words."""
        missing = []
        if kernel.function != self.function:
            missing.append(f"{self.function} attention (it computes {kernel.function} attention)")
        if self.score_bias and not kernel.score_bias:
            missing.append("a position score bias")
        if self.bias_gradients and not kernel.bias_gradients:
            missing.append("gradients through a learned score bias")
        if self.dropout and not kernel.dropout:
            missing.append("attention dropout")
        if self.backward_on and kernel.backward_devices is not None and self.backward_on not in kernel.backward_devices:
            missing.append(f"a backward pass on {self.backward_on}")
        if self.score not in kernel.scores:
            missing.append(f"the {self.score} score")
        if self.sparse_mask and not kernel.sparse_masks:
            missing.append("a mask beyond causal (attn_window, attn_sinks)")
        return missing


@dataclass(frozen=True)
class Kernel:
    """An attention kernel and what it declares it can run."""

    name: str
    function: str
    """The attention function it computes: softmax, or linear (a different function, not a kernel for softmax)."""
    run: Callable[[Tensor, Tensor, Tensor, AttentionContext, float, Score], Tensor]
    score_bias: bool
    bias_gradients: bool
    dropout: bool
    backward_devices: frozenset[str] | None
    """Devices with a backward pass (None: every device)."""
    auto_devices: frozenset[str] | None
    """Devices where `auto` may pick it (None: every device)."""
    sparse_masks: bool
    weights: bool
    """Can return the attention weights (attention maps)."""
    scores: frozenset[str]
    """Scoring functions it computes (`model.scores`)."""


def needs_of(
    pe: PositionEncoding,
    mask: AttentionMask,
    device: torch.device,
    dropout_active: bool,
    needs_grad: bool,
    decoding: bool,
    function: str = "softmax",
    score: str = "scaled_dot",
) -> Needs:
    """What a forward pass of a model with scheme `pe` and `mask` asks of a kernel. Linear attention
    has no attention weights to drop: dropout there applies to embeddings and residual branches."""
    return Needs(
        function=function,
        score_bias=pe.bias_kind is not None,
        bias_gradients=pe.bias_kind == "learned" and needs_grad,
        dropout=dropout_active and function == "softmax",
        backward_on=device.type if needs_grad else None,
        sparse_mask=not mask.causal_only,
        decoding=decoding,
        score=score,
    )


def choose_kernel(requested: str, needs: Needs, device: torch.device) -> Kernel:
    """The kernel `requested` names, or for 'auto' the first one of the device's preference order
    that can run `needs` (see the module docstring); an explicit kernel that cannot is an error."""
    if requested != "auto":
        kernel = KERNELS.get((needs.function, requested)) or _kernel(requested)
        missing = needs.unmet(kernel)
        if missing:
            able = [k.name for k in KERNELS.values() if not needs.unmet(k)]
            raise RuntimeError(
                f"attn_backend={requested!r} cannot run this configuration: it lacks {', '.join(missing)}. "
                f"Kernels that can: {', '.join(able) or 'none'} (or attn_backend='auto')."
            )
        return kernel
    if needs.function == "linear":
        order: tuple[str, ...] = ("chunked", "eager")
    elif device.type == "cuda" and (needs.score_bias or needs.sparse_mask) and not needs.decoding:
        order = ("flex", "sdpa", "eager")
    else:
        order = ("sdpa", "flex", "eager")
    unmet: list[str] = []
    for name in order:
        kernel = KERNELS[(needs.function, name)]
        if kernel.auto_devices is not None and device.type not in kernel.auto_devices:
            continue
        unmet = needs.unmet(kernel)
        if not unmet:
            return kernel
    raise RuntimeError(f"No attention kernel can run this configuration on {device.type}: none has {', '.join(unmet)}.")


def weights_kernel(needs: Needs) -> Kernel:
    """The kernel that forms the attention weights for `needs`: the reference path of the attention
    function (fused kernels never form them)."""
    for kernel in KERNELS.values():
        if kernel.weights and not needs.unmet(kernel):
            return kernel
    raise RuntimeError(f"No kernel forms the weights of {needs.function} attention here.")


def check_kernel(
    requested: str, pe: PositionEncoding, mask: AttentionMask, dropout: bool, function: str, score: str
) -> None:
    """At construction: refuse a model that no kernel can run (linear attention with a score bias or
    a window), and an explicit kernel that cannot run the scheme, the mask or the dropout at all
    (the needs that depend on the device and on gradients are checked at each forward)."""
    needs = Needs(
        function=function,
        score_bias=pe.bias_kind is not None,
        sparse_mask=not mask.causal_only,
        dropout=dropout and function == "softmax",
        score=score,
    )
    try:
        choose_kernel(requested, needs, torch.device("cpu"))
    except RuntimeError as error:
        raise ValueError(str(error)) from None


def _kernel(name: str) -> Kernel:
    for kernel in KERNELS.values():
        if kernel.name == name:
            return kernel
    raise ValueError(f"Unknown attention kernel {name!r}; valid: auto, {', '.join(k.name for k in KERNELS.values())}.")


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) bool, True where query i (at position k_len - q_len + i) may attend to key j."""
    return AttentionMask().dense(torch.arange(k_len - q_len, k_len, device=device), torch.arange(k_len, device=device))


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    mask: Tensor | None = None,
    score: Score | None = None,
    on_weights: WeightsHook | None = None,
) -> Tensor:
    """softmax(score(q, k) + bias, over the visible keys) v, written out in (at least) float32: the
    reference every kernel is tested against. The score is q k^T / sqrt(D) unless `score` says
    otherwise (`model.scores`); queries are taken in chunks when the score needs it (additive).

    Args:
        q: (B, H, Tq, D) queries; k, v: (B, H, Tk, D) keys and values.
        bias: additive (H, Tq, Tk) or (B, H, Tq, Tk) score bias (-inf where not visible), or None.
        dropout_p: dropout on the attention weights.
        mask: (Tq, Tk) bool visibility; None is plain causal (the queries are the last Tq keys).
        score: the scoring function (default: scaled dot product).
        on_weights: called with each chunk of weights (query rows, (B, H, rows, Tk), after dropout),
            chunks then small enough that no (B, H, Tq, Tk) tensor is formed at long lengths.

    Returns:
        The (B, H, Tq, D) output in q's dtype.
    """
    q_len, k_len = q.size(-2), k.size(-2)
    dtype = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 if given float64
    score = score if score is not None else ScaledDot(q.size(-1))
    visible = mask if mask is not None else causal_mask(q_len, k_len, q.device)
    qw, kw, vw = q.to(dtype), k.to(dtype), v.to(dtype)
    outs = []
    step = score.query_chunk(qw, kw)
    if on_weights is not None:
        step = min(step, max(1, WEIGHTS_CHUNK_ELEMENTS // (q.size(0) * q.size(1) * k_len)))
    for c in range(0, q_len, step):
        rows = slice(c, min(c + step, q_len))
        scores = score(qw[:, :, rows], kw)  # (B, H, chunk, Tk)
        if bias is not None:
            scores = scores + bias[..., rows, :].to(dtype)
        scores = scores.masked_fill(~visible[rows], float("-inf"))
        weights = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p)
        outs.append(weights @ vw)  # (B, H, chunk, D)
        if on_weights is not None:
            on_weights(rows, weights)
    return torch.cat(outs, dim=2).to(q.dtype)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """PyTorch's fused scaled_dot_product_attention.

    Plain causal attention (no bias, `mask` None) uses `is_causal=True` and no mask, which lets
    PyTorch pick its FlashAttention kernel on GPU. A bias (ALiBi, T5) goes in as a float mask that
    already holds -inf where keys are not visible, a window as a boolean mask; no flash kernel
    accepts either, so those keep a (H, Tq, Tk) tensor in memory.

    On a CPU, bf16 / fp16 inputs (under bf16 autocast) are attended in float32: the fused CPU
    kernel's bf16 forward + backward measured 1.1-4x slower than its float32 one up to 512 tokens
    (BENCHMARKS.md, "bf16 on the CPU"), while the matmuls around it run 2x faster in bf16.
    """
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        with torch.autocast("cpu", enabled=False):
            return _sdpa(q.float(), k.float(), v.float(), bias, dropout_p, mask, scale).to(q.dtype)
    return _sdpa(q, k, v, bias, dropout_p, mask, scale)


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, dropout_p: float, mask: Tensor | None, scale: float | None
) -> Tensor:
    q_len, k_len = q.size(-2), k.size(-2)
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout_p, scale=scale)
    if bias is not None:
        return sdpa(q, k, v, attn_mask=bias.to(q.dtype))
    if mask is not None:
        return sdpa(q, k, v, attn_mask=mask)
    if q_len == k_len:
        return sdpa(q, k, v, is_causal=True)
    if q_len == 1:  # one new token attends to every cached key: no mask at all
        return sdpa(q, k, v)
    return sdpa(q, k, v, attn_mask=causal_mask(q_len, k_len, q.device))


@functools.cache
def compiled_flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled once per process and shared by every layer and model.

    Compiling at first use (not at import) keeps `import model` cheap; without compilation
    flex_attention falls back to an unfused path that materializes the full score matrix.
    """
    return torch.compile(flex_attention)


@functools.cache
def compiled_create_block_mask() -> Callable[..., BlockMask]:
    """create_block_mask compiled once per process (as torchtitan does): uncompiled, it builds the
    dense Tq x Tk mask that a block mask exists to avoid."""
    return torch.compile(create_block_mask)


def flex_attention_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask: BlockMask,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
) -> Tensor:
    """FlexAttention: the block mask and an optional score_mod (a position bias), fused in one kernel."""
    return compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)


def _run_eager(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dropout_p: float, score: Score) -> Tensor:
    return eager_attention(q, k, v, ctx.bias, dropout_p, mask=ctx.mask, score=score, on_weights=ctx.on_weights)


def _run_sdpa(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dropout_p: float, score: Score) -> Tensor:
    return sdpa_attention(q, k, v, ctx.bias, dropout_p, mask=ctx.mask, scale=score.scale)


def _run_flex(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dropout_p: float, score: Score) -> Tensor:
    assert ctx.block_mask is not None, "build_context makes a block mask for flex"
    return flex_attention_fused(q, k, v, ctx.block_mask, ctx.score_mod, scale=score.scale)


def _run_linear_quadratic(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dropout_p: float, score: Score
) -> Tensor:
    return linear_attention_quadratic(q, k, v, on_weights=ctx.on_weights)


def _run_linear_chunked(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dropout_p: float, score: Score
) -> Tensor:
    return linear_attention_chunked(q, k, v)[0]


DOT_SCORES = frozenset({"scaled_dot", "dot"})
ALL_SCORES = frozenset({"scaled_dot", "dot", "additive"})


KERNELS: dict[tuple[str, str], Kernel] = {
    ("softmax", "eager"): Kernel(
        "eager", "softmax", _run_eager, score_bias=True, bias_gradients=True, dropout=True, backward_devices=None,
        auto_devices=None, sparse_masks=True, weights=True, scores=ALL_SCORES,
    ),
    ("softmax", "sdpa"): Kernel(
        "sdpa", "softmax", _run_sdpa, score_bias=True, bias_gradients=True, dropout=True, backward_devices=None,
        auto_devices=None, sparse_masks=True, weights=False, scores=DOT_SCORES,
    ),
    ("softmax", "flex"): Kernel(
        "flex", "softmax", _run_flex, score_bias=True, bias_gradients=True, dropout=False,
        backward_devices=frozenset({"cuda"}), auto_devices=frozenset({"cuda"}), sparse_masks=True, weights=False,
        scores=DOT_SCORES,
    ),
    ("linear", "eager"): Kernel(
        "eager", "linear", _run_linear_quadratic, score_bias=False, bias_gradients=False, dropout=False,
        backward_devices=None, auto_devices=None, sparse_masks=False, weights=True,
        scores=frozenset({"scaled_dot"}),
    ),
    ("linear", "chunked"): Kernel(
        "chunked", "linear", _run_linear_chunked, score_bias=False, bias_gradients=False, dropout=False,
        backward_devices=None, auto_devices=None, sparse_masks=False, weights=False,
        scores=frozenset({"scaled_dot"}),
    ),
}  # fmt: skip
"""The attention kernels by (attention function, name), each with what it declares it can run
(see `Kernel`). Linear attention's kernels take q and k as [R phi(x), phi(x)] (`model.linear_attention`)."""
