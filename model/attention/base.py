"""The base of the attention layers (`model.attention`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from posgpt.model.kernels import AUTO, Kernel, KernelError, Needs, Placement, Plan
from posgpt.model.masks import AttentionMask
from posgpt.model.positions import PositionEncoding
from posgpt.model.scores import SCORES, Score
from posgpt.model.terms import Term

if TYPE_CHECKING:
    from posgpt.model.cache import CachePart
    from posgpt.model.config import GPTConfig


def wide(x: Tensor) -> Tensor:
    """`x` in float32 at least (float64 stays): what sums and states are kept in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass(frozen=True)
class QKNorm:
    """A variant of QK-norm (`GPTConfig.qk_norm`): each head's queries and keys RMS-normalised."""

    learned: bool
    """A learned scale per dimension."""
    after_rotation: bool
    """Normalised after the rotation, on rotating layers only (else before it, on every layer)."""
    eps: float


QK_NORMS: dict[str, QKNorm | None] = {
    "none": None,
    "gemma3": QKNorm(learned=True, after_rotation=False, eps=1e-6),  # Gemma 3's and Qwen3's
    "llama4": QKNorm(learned=False, after_rotation=True, eps=1e-5),  # Llama 4's L2Norm
}


class Attention(nn.Module):
    """Base of the attention layers: q/k/v and output projections, dropout, the scoring function, and, as class
    attributes, what the attention function is."""

    kernels: ClassVar[Mapping[str, Kernel]]
    """This function's kernels by `attn_backend` name."""
    drops_weights: ClassVar[bool] = True
    """Attention dropout (`config.dropout`) applies to its weights."""
    scored: ClassVar[bool] = True
    """It scores query-key pairs with `config.attn_score`."""
    value_passes: ClassVar[int] = 1
    """Weighted sums of the values per query (the FLOP count's): two for differential attention."""
    terms: ClassVar[frozenset[Term]] = frozenset()
    """What it does to the scores itself (`model.terms`; FoX: `TOKENS`, its gate sums, learned)."""
    takes_positions: ClassVar[bool] = True
    """Its layers read a position scheme that acts in attention, a mask and KV heads (the delta rules read none: their
    convolution and decay carry order); a kind of it takes none of the model's (`model.layout`)."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.qkv = nn.Linear(config.n_embd, config.n_embd + 2 * self.n_kv_head * self.head_dim, config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.score = SCORES[config.attn_score].build(config)
        norm = QK_NORMS[config.qk_norm]  # before the rotation (on every layer) or after it (on rotating layers)
        self.q_norm, self.k_norm = (None if norm is None else nn.RMSNorm(
            self.head_dim, eps=norm.eps, elementwise_affine=norm.learned) for _ in range(2))  # fmt: skip
        self.norm_rotated = norm is not None and norm.after_rotation
        gate = {"none": 0, "elementwise": config.n_embd, "headwise": config.n_head}[config.attn_gate]
        self.gate = nn.Linear(config.n_embd, gate, config.bias) if gate else None
        self.sinks = nn.Parameter(torch.zeros(config.n_head)) if config.attn_sink_logits else None
        self.softcap = config.attn_softcap

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> queries (B, H, T, D), keys and values (B, H_kv, T, D), QK-normed before any rotation."""
        B, T, C = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([C, kv, kv], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2) for t in (k, v))
        if not self.norm_rotated:
            q, k = self.qk_norm(q, k)
        return q, k, v

    def qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and keys RMS-normalised (`qk_norm`), in a learned scale's dtype (float32 under autocast)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        dtype = q.dtype if self.q_norm.weight is None else self.q_norm.weight.dtype
        return self.q_norm(q.to(dtype)).to(q.dtype), self.k_norm(k.to(dtype)).to(k.dtype)

    def attend(self, plan: Plan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The plan's attention of q, k, v with this layer's own terms: its soft-cap and sink logits."""
        if self.softcap or self.sinks is not None:
            cap = self.softcap
            transform = (lambda scores: cap * torch.tanh(scores / cap)) if cap else None  # Gemma 2's soft-cap
            sinks = None if self.sinks is None else wide(self.sinks)
            plan = dataclasses.replace(plan, transform=transform, sinks=sinks)
        return plan.attend(q, k, v, self.score, self.dropout if self.training else 0.0)

    def output(self, y: Tensor, x: Tensor) -> Tensor:
        """(B, H, T, D) attention output, gated by the layer input `x` (B, T, C) (`attn_gate`) -> (B, T, C)
        residual branch."""
        B, _, T, _ = y.shape
        if self.gate is not None:  # per element or per head: (B, T, H, D or 1)
            y = y * torch.sigmoid(self.gate(x)).view(B, T, self.n_head, -1).transpose(1, 2).to(y.dtype)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.proj(y))

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        """Raise `ConfigError` when the function cannot work with `config` (called at its validation)."""

    @classmethod
    def mixing_flops(cls, config: GPTConfig, mask: AttentionMask, seq_len: int) -> int:
        """Training FLOPs per token of one layer's mixing beyond its parameters' 6N: 6 C per key the token sees (the
        scores) and as much per weighted sum of the values (PaLM appendix B; differential attention has two)."""
        return 6 * config.n_embd * mask.attended_keys(seq_len) * (1 + cls.value_passes)

    @classmethod
    def kernel_head_size(cls, head_dim: int) -> int:
        """The head size of the queries and keys its kernels see (some kernels need a minimum)."""
        return head_dim

    @classmethod
    def rotary_dim(cls, config: GPTConfig) -> int:
        """The width of the vectors the position scheme rotates as one (`rotate`): a head's."""
        return config.head_dim

    @classmethod
    def kernel_settings(cls, config: GPTConfig) -> dict[str, Any]:
        """The function's own settings its kernels' `context` takes as keywords (none by default)."""
        return {}

    def rotate(self, pe: PositionEncoding, q: Tensor, k: Tensor, placement: Placement) -> tuple[Tensor, Tensor]:
        """The scheme's rotation of queries and keys (B, H, T, D) at the pass's positions."""
        return pe.rotate(q, k, placement.positions, placement.rotation)

    def reconfigure(self, old: GPTConfig, config: GPTConfig) -> None:
        """Take the mask and scaling of `config` (`GPT.switch`), keeping the weights."""

    def reconfigure_replaces_parameters(self, old: GPTConfig, config: GPTConfig) -> bool:
        """Whether `reconfigure(old, config)` would put new parameters in place of old ones."""
        return False

    @classmethod
    def needs(
        cls,
        pe: PositionEncoding | type[PositionEncoding],
        mask: AttentionMask,
        score: type[Score],
        device: torch.device | None = None,
        dropout_active: bool = False,
        needs_grad: bool = False,
        decoding: bool = False,
        head_size: int | None = None,
        float64: bool = False,
        asked: frozenset[Term] = frozenset(),
    ) -> Needs:
        """What a forward pass with scheme `pe`, `mask` and `score` asks of the kernels (no device: any), with the
        layers' own terms `asked` (`layer_terms`)."""
        return Needs(
            terms=pe.terms | cls.terms | asked | ({Term.MASK} if not mask.causal_only else set()),
            term_gradients=(pe.learned_bias or bool(cls.terms) or Term.MASS in asked) and needs_grad,
            dropout=dropout_active and cls.drops_weights,
            backward_on=device.type if needs_grad and device is not None else None,
            runs_on=device.type if device is not None else None,
            decoding=decoding,
            dot_score=score.dot_product or not cls.scored,
            head_size=head_size,
            float64=float64,
            window_only=mask.window_only,
            table_gradients=pe.learned_bias and needs_grad,
        )

    @staticmethod
    def layer_terms(config: GPTConfig) -> frozenset[Term]:
        """The terms a layer of `config` adds itself (`attend`): a soft-cap, sink logits."""
        return frozenset(term for term, on in ((Term.TRANSFORM, config.attn_softcap), (Term.MASS,
                         config.attn_sink_logits)) if on)  # fmt: skip

    @classmethod
    def choose_kernel(cls, requested: str, needs: Needs, device: torch.device) -> Kernel:
        """The kernel `requested` names (an error if it cannot run `needs`), or for 'auto' the able one of lowest
        `rank`; decoding, a named kernel that does not decode (fla's) leaves it to 'auto'."""
        kernels = cls.kernels
        if requested != AUTO and needs.decoding and not kernels[requested].decodes:
            requested = AUTO
        if requested != AUTO:  # one of `kernels`: check_config refuses any other attn_backend
            missing = needs.unmet(kernels[requested])
            if missing:
                able = [name for name, k in kernels.items() if not needs.unmet(k)]
                raise KernelError(
                    f"attn_backend={requested!r} cannot run this configuration: it lacks "
                    f"{', '.join(lack.words for lack in missing)}. "
                    f"Kernels that can: {', '.join(able) or 'none'} (or attn_backend={AUTO!r})."
                )
            return kernels[requested]
        best: Kernel | None = None
        for kernel in kernels.values():  # a plain loop: under torch.compile it traces to a constant choice
            if kernel.auto_devices is not None and device.type not in kernel.auto_devices:
                continue
            if not needs.unmet(kernel) and (best is None or kernel.rank(needs, device) < best.rank(needs, device)):
                best = kernel
        if best is None:
            fewest = min((needs.unmet(kernel) for kernel in kernels.values()), key=len)
            raise KernelError(
                f"No attention kernel can run this configuration on {device.type}: none has "
                f"{', '.join(lack.words for lack in fewest)}."
            )
        return best

    @classmethod
    def kernel_name(cls, kernel: Kernel) -> str:
        return next(name for name, k in cls.kernels.items() if k is kernel)

    @classmethod
    def weights_kernel(cls, needs: Needs) -> Kernel:
        """The kernel that forms the attention weights for `needs` (fused kernels never do)."""
        for kernel in cls.kernels.values():
            if kernel.weights and not needs.unmet(kernel):
                return kernel
        raise KernelError("No kernel here forms the attention weights of this model.")

    @classmethod
    def new_cache(cls, config: GPTConfig, mask: AttentionMask, capacity: int, layers: int) -> CachePart:
        """What decoding keeps for `layers` layers of `config` (see `GPT.new_cache`)."""
        raise NotImplementedError

    @classmethod
    def constant_memory(cls, config: GPTConfig, mask: AttentionMask) -> bool:
        """Whether what decoding keeps stays the same size however long it runs."""
        raise NotImplementedError
