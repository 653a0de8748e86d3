"""Schemes that bias the attention scores (`bias`, a `ScoreBias`): ALiBi, T5, Kerple, FIRE, and CoPE, whose term is
computed from the scores."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from posgpt.core.errors import ConfigError
from posgpt.model.positions.base import PositionEncoding, separate
from posgpt.model.terms import ScoreBias, Term

if TYPE_CHECKING:
    from posgpt.model.config import GPTConfig


class ALiBi(PositionEncoding):
    """No position vectors; head h adds −m_h·(i − j) to its causal scores, with the paper's slopes (Press et al.
    2022), designed to extrapolate."""

    terms = frozenset({Term.POSITIONS})
    relative = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(config.n_head), dtype=torch.float32), persistent=False)

    def bias(self, layer: int = 0) -> ScoreBias:
        if self.slopes.dtype != torch.float32:  # e.g. after model.to(torch.bfloat16): one slope per head again
            self.slopes = torch.tensor(alibi_slopes(len(self.slopes)), dtype=torch.float32, device=self.slopes.device)
        slopes = self.slopes

        def alibi(h: Tensor, distance: Tensor, query: Tensor) -> Tensor:
            return -slopes[h] * distance

        return ScoreBias(alibi, len(slopes))


T5_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}
"""FlexAttention's tiles for T5 on CUDA: with the default ones (128 wide, 3 stages) T5's score_mod in bf16
asked an H200 for more shared memory than it has ("No valid triton configs"); these need under half
(not yet run on a GPU)."""


class T5Bias(PositionEncoding):
    """T5's relative position bias (Raffel et al. 2020), causal: a learned scalar per head for each bucket of
    distance i − j; `t5_num_buckets` (32) buckets, the first half one distance each, the rest log-spaced up to
    `t5_max_distance` (128), beyond which the last bucket saturates. One table, shared by every layer.

    The bucket (`t5_bucket`) is counted in the formula from the distances where the log-spaced buckets start, so
    the kernel gathers from the table alone (a gather of an int64 bucket table per score ran out of shared memory
    in flex on an H200)."""

    terms = frozenset({Term.POSITIONS})
    relative = True
    learned_bias = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.num_buckets, self.max_distance = config.t5_num_buckets, config.t5_max_distance
        self.table = nn.Parameter(torch.empty(config.t5_num_buckets, config.n_head))  # (buckets, H)
        # on the CPU, also where the model is built on the meta device (estimates): plain numbers
        buckets = t5_bucket(torch.arange(self.max_distance + 1, device="cpu"), self.num_buckets, self.max_distance)
        later = torch.arange(self.num_buckets // 2 + 1, int(buckets[-1]) + 1, device="cpu")  # log-spaced, not the first
        self.starts = torch.searchsorted(buckets, later).tolist()
        """The distance at which each of those buckets starts."""
        self.reset_parameters()

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        if config.t5_num_buckets < 2 or config.t5_max_distance <= config.t5_num_buckets // 2:
            raise ConfigError(
                f"GPTConfig.t5_num_buckets must be >= 2 and t5_max_distance above half of it (the exact buckets), "
                f"got {config.t5_num_buckets} and {config.t5_max_distance}."
            )

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table, mean=0.0, std=0.02)  # the scale of GPT-2's other weights

    def lookup_parameters(self) -> list[nn.Parameter]:
        return [self.table]

    def bias(self, layer: int = 0) -> ScoreBias:
        table, exact, starts = self.table.float(), self.num_buckets // 2, self.starts

        def t5(h: Tensor, distance: Tensor, query: Tensor) -> Tensor:
            d = distance.clamp(min=0)  # future keys: masked by the kernel
            bucket = d.clamp(max=exact)
            for start in starts:  # saturates at max_distance's bucket
                bucket = bucket + (d >= start)
            return table[bucket, h]

        return ScoreBias(t5, self.table.size(1) + 2, T5_TILES)  # the bias per head, the int64 bucket per pair


class Kerple(PositionEncoding):
    """KERPLE's logarithmic kernel (Chi et al. 2022), causal: head h adds −r1_h·log(1 + r2_h·(i − j)), r1_h and
    r2_h learned per head (kept ≥ 0.01); shared by every layer.

    r1, r2 are used at least `EPS` with a straight-through gradient (their code clamps the parameters in place), so
    a parameter pushed below EPS can come back."""

    terms = frozenset({Term.POSITIONS})
    relative = True
    learned_bias = True
    EPS = 1e-2

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.r1 = nn.Parameter(torch.empty(config.n_head))
        self.r2 = nn.Parameter(torch.empty(config.n_head))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.r1, 0.0, 2.0)  # the paper's code: r1 ~ U(0, 2), r2 ~ U(0, 1), per head
        nn.init.uniform_(self.r2, 0.0, 1.0)

    def bias(self, layer: int = 0) -> ScoreBias:
        r1, r2 = (torch.where(r < self.EPS, self.EPS + (r - r.detach()), r) for r in (self.r1.float(), self.r2.float()))

        def kerple(h: Tensor, distance: Tensor, query: Tensor) -> Tensor:
            # future keys (distance < 0) are masked by the kernel, but their bias must stay finite
            return -r1[h] * torch.log1p(r2[h] * distance.clamp(min=0))

        return ScoreBias(kerple, self.r1.numel())


def t5_bucket(distance: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's causal bucket of each distance q - k (`_relative_position_bucket`, bidirectional=False): d below
    N/2, else N/2 + floor(ln(d / (N/2)) / ln(max_distance / (N/2)) * (N - N/2)), at most N - 1."""
    exact = num_buckets // 2
    d = distance.clamp(min=0)
    log_ratio = torch.log(d.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(d < exact, d, large)


def alibi_slopes(n_head: int) -> list[float]:
    """The ALiBi paper's slopes: 2^(-8/n) to the powers 1..n for n a power of two, else those of the closest
    smaller power of two plus every other slope of twice it (their code's `get_slopes`)."""

    def power_of_two(n: int) -> list[float]:
        return [(2.0 ** (-8.0 / n)) ** (i + 1) for i in range(n)]

    if n_head & (n_head - 1) == 0:
        return power_of_two(n_head)
    closest = 2 ** math.floor(math.log2(n_head))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_head - closest]


class FIRE(PositionEncoding):
    """FIRE (Li et al. 2024), causal: head h adds f(ψ(i − j) / ψ(max(L, i)))_h, ψ(x) = ln(|c|·x + 1), f an MLP
    from one input to one output per head (`fire_width` 32 hidden ReLU units), c from 0.1, L = |m·L₀| with m
    learned from 1 and L₀ = block_size/4; the input stays in [0, 1] at every length, so a longer context is a finer
    grid of what training saw. Shared by every layer (the paper's FIRE-S), or one c, L and MLP per layer with
    `fire_per_layer` (its FIRE). Written pointwise, so FlexAttention runs the MLP inside its kernel.

    L₀: their code has 512 for 2048 tokens, an assumption here; 1e-6 added to the normalizer keeps c -> 0 finite."""

    terms = frozenset({Term.POSITIONS})
    learned_bias = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.width, self.n_head, self.per_layer = config.fire_width, config.n_head, config.fire_per_layer
        self.bias_layers = config.n_layer if config.fire_per_layer else 1
        per_layer = (self.bias_layers,) if config.fire_per_layer else ()  # shared: the shapes FIRE-S always had
        self.c = nn.Parameter(torch.empty(per_layer))
        # L = |m L0|: the multiplier m is learned from 1 (their code), so that L moves at lr x L0 a step
        self.threshold_scale = nn.Parameter(torch.empty(per_layer))
        self.register_buffer("initial_threshold", torch.tensor(max(1.0, config.block_size / 4)), persistent=False)
        # per layer: the layers' first-layer weights one after the other, 1-D like the shared ones (no weight decay)
        self.w1 = nn.Parameter(torch.empty(self.bias_layers * config.fire_width))
        self.b1 = nn.Parameter(torch.empty(self.bias_layers * config.fire_width))
        self.w2 = nn.Parameter(torch.empty(config.fire_width, self.bias_layers * config.n_head))
        self.b2 = nn.Parameter(torch.empty(self.bias_layers * config.n_head))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.c, 0.1)
        nn.init.constant_(self.threshold_scale, 1.0)
        for weight, bias, fan_in in ((self.w1, self.b1, 1), (self.w2, self.b2, self.w2.size(0))):
            bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default init
            nn.init.uniform_(weight, -bound, bound)
            nn.init.uniform_(bias, -bound, bound)

    def bias(self, layer: int = 0) -> ScoreBias:
        # every value the formula reads, per head and on its own (`ScoreBias`): |c| twice, L, each hidden
        # unit's input weight and bias, each unit's output weights, the output bias
        units = slice(layer * self.width, (layer + 1) * self.width) if self.per_layer else slice(None)
        heads = slice(layer * self.n_head, (layer + 1) * self.n_head) if self.per_layer else slice(None)
        c, m = ((p.float()[layer] if self.per_layer else p.float()).abs() for p in (self.c, self.threshold_scale))
        scalars = torch.stack([c, c, m * self.initial_threshold.float()])[:, None]  # L = |m L0|
        per_unit = torch.stack([self.w1.float()[units], self.b1.float()[units]])[..., None]
        rows = torch.cat([scalars.expand(3, self.n_head), per_unit.expand(2, self.width, self.n_head).flatten(0, 1),
                          self.w2.float()[:, heads], self.b2.float()[heads][None]])  # fmt: skip
        c_distance, c_position, threshold, *rest = separate(rows)
        w1, b1, w2, (b2,) = rest[: self.width], rest[self.width : 2 * self.width], rest[2 * self.width : -1], rest[-1:]

        def fire(h: Tensor, distance: Tensor, query: Tensor) -> Tensor:
            # psi(i - j) / psi(max(L, i)); future keys are masked, but their bias must stay finite
            psi_distance = torch.log1p(c_distance[h] * distance.clamp(min=0).float())
            x = psi_distance / (torch.log1p(c_position[h] * torch.maximum(query.float(), threshold[h])) + 1e-6)
            # the MLP one hidden unit at a time: pointwise arithmetic, which FlexAttention fuses into its
            # kernel (a matmul in a score_mod cannot be), and no (..., width) tensor on the dense path
            bias = b2[h]
            for unit in range(self.width):
                bias = bias + w2[unit][h] * torch.relu(w1[unit][h] * x + b1[unit][h])
            return bias

        # the bias, a product, the normalized distance and each hidden unit's output, per head
        return ScoreBias(fire, (self.width + 4) * self.n_head + 4)


class ContextualPositions(PositionEncoding):
    """CoPE (Golovneva et al. 2024): positions that depend on the content, counted over the keys a query sees. It
    needs the scores, so it runs on the eager kernel; its KV cache never rolls (the counts run over keys in order).

    The authors' code: facebookresearch/RAM projects/cope `ContextPosSelfAttn`. Query i gates each key it sees,
    g_ij = sigmoid(s_ij), s the score (q_i . k_j / sqrt(d)), and counts the gates from key j up to itself:
    p_ij = sum_{t=j..i} g_it, clamped to P - 1 (P = `cope_positions`). A learned vector e[p] per integer position,
    one (D, P) table per layer shared by its heads and started at zero, is read between floor(p) and ceil(p) on
    the logits q_i . e: the term (1 - w) q.e[floor p] + w q.e[ceil p], w = p - floor p, is divided by sqrt(d)
    with q.k (their training code, `cope_divide`) or added undivided (the paper's appendix code)."""

    terms = frozenset({Term.FROM_SCORES})
    learned_bias = True
    uses_positions = False  # it counts what the query attends to, not indices

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.bias_layers, self.n_head = config.n_layer, config.n_head
        positions = self.sized_settings(config)["cope_positions"]
        self.table = nn.Parameter(torch.zeros(config.n_layer, config.head_dim, positions))
        self.scale = 1 / math.sqrt(config.head_dim) if config.cope_divide else 1.0

    @classmethod
    def sized_settings(cls, config: GPTConfig) -> dict[str, Any]:
        return {"cope_positions": config.cope_positions or config.block_size + 1}  # theirs: every count to block_size

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.table)

    def bias(self, layer: int = 0) -> ScoreBias:
        table, scale = self.table[layer].to(torch.promote_types(self.table.dtype, torch.float32)), self.scale
        # elements: the gates, counts, interpolation and term it forms per query-key pair and head
        return ScoreBias(None, 12 * self.n_head, from_scores=lambda q, scores, visible: ContextualTerm.apply(
            q, scores, table.to(q.dtype), scale))  # fmt: skip


class ContextualTerm(torch.autograd.Function):
    """CoPE's term of query rows q (B, H, rows, D) and their scores (-inf where not visible) with a layer's table
    (D, P), its gradient written out: the graph keeps the gates and the logits' step, where autograd's kept counts,
    weights and two int64 indices per pair (issue 62). Gates g = sigmoid(s); counts p_j = min(sum_{t>=j} g_t, P - 1)
    in float32; logits z = q e; the term scale * ((1 - w) z[floor p] + w z[ceil p]), w = p - floor p."""

    @staticmethod
    def positions(gates: Tensor, last: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The counts before clamping, the neighbouring positions (int64) and the weight w of the upper one."""
        counts = gates.flip(-1).cumsum(-1, dtype=torch.promote_types(gates.dtype, torch.float32)).flip(-1)
        p = counts.clamp(max=last)
        low = p.floor()
        return counts, low.long(), p.ceil().long(), p - low

    @staticmethod
    def forward(ctx: Any, q: Tensor, scores: Tensor, table: Tensor, scale: float) -> Tensor:
        gates = torch.sigmoid(scores)  # 0 where a key is not visible (a score of -inf)
        _, low, high, w = ContextualTerm.positions(gates, table.size(-1) - 1)
        logits = q @ table  # (B, H, rows, P): the query against every position
        below = logits.gather(-1, low)
        step = logits.gather(-1, high).sub_(below)  # z[ceil p] - z[floor p], kept: no logits formed again
        ctx.save_for_backward(q, gates, table, step)
        ctx.scale = scale
        return scale * (below + w * step)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, gates, table, step = ctx.saved_tensors
        last = table.size(-1) - 1
        counts, low, high, w = ContextualTerm.positions(gates, last)
        grad = grad.to(q.dtype) * ctx.scale  # (bf16 under autocast, as the scores)
        d_counts = (grad * step).masked_fill_(counts > last, 0)
        d_scores = d_counts.cumsum(-1).mul_(gates * (1 - gates))  # each gate counts for the keys j up to it
        d_logits = q.new_zeros(*q.shape[:-1], table.size(-1))
        d_logits.scatter_add_(-1, low, grad - grad * w).scatter_add_(-1, high, grad * w)
        d_table = q.reshape(-1, q.size(-1)).mT @ d_logits.view(-1, d_logits.size(-1))
        return d_logits @ table.mT, d_scores, d_table, None
