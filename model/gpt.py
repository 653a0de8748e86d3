"""The GPT: token embedding -> position scheme -> pre-LayerNorm blocks -> final LayerNorm -> tied head."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posgpt.model.attention import Attention
from posgpt.model.cache import DecodingCache
from posgpt.model.config import GPTConfig
from posgpt.model.generation import stream
from posgpt.model.kernels import Kernel, Placement, Plan, WeightsHook
from posgpt.model.layout import LayerKind, layer_kinds, scheme_differs
from posgpt.model.loss import linear_cross_entropy
from posgpt.model.positions import SCHEMES, PositionEncoding, build_positions
from posgpt.model.roles import Role
from posgpt.model.scores import SCORES


class MLP(nn.Module):
    """Position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)  # exact (nanoGPT) or tanh (GPT-2)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, attention: type[Attention], layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = attention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, pe: PositionEncoding, plan: Plan, cache: Any = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), pe, plan, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer whose position scheme is `config.pos_encoding`.

    Example:
        >>> model = GPT(GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384))
        >>> logits, loss = model(idx, targets)  # idx, targets: (B, T) int64; targets of -1 ignored
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.pe = build_positions(config)  # one instance, shared by every block of the model's scheme
        self.kinds = layer_kinds(config)  # the layers of each kind, each with its mask, and `kind_of` each layer's
        self.kind_pe = nn.ModuleDict()  # a kind's own scheme, by its name, where it is not the model's
        self._take_schemes(config, self.kinds)
        # what each kernel keeps across forwards (flex: block masks), by kernel class (a copied model has copies
        # of the kernels); made now, so that a compiled forward never sees the dict change
        self._kernel_memos: dict = {type(k): {} for kind in self.kinds for k in kind.attention.kernels.values()}
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(kind.config, kind.attention, i) for i, kind in enumerate(self.kind_of))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings (Press & Wolf 2017)
        self.activation_checkpointing = False
        """Recompute each block in the backward pass (`train.activation_checkpointing`): how to train, not config."""
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation (Radford et al. 2019), as nanoGPT does it: Linear and Embedding weights normal(0, 0.02),
        biases 0, the residual output projections normal(0, 0.02 / sqrt(2 L)): the 2L branches add to one stream,
        whose variance then does not grow with depth. The scheme initialises its own (`reset_parameters`); modules
        are visited in registration order, which fixes the weights a seed gives."""
        for name, module in self.named_modules():
            if isinstance(module, (PositionEncoding, nn.LayerNorm)):  # the schemes: the model's, each kind's
                module.reset_parameters()
            if name.split(".")[0] in ("pe", "kind_pe"):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):  # Conv1d: fla's init of short convolutions
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)
            if block.attn.sinks is not None:  # Hugging Face's gpt-oss init (the official code only loads them)
                nn.init.normal_(block.attn.sinks, mean=0.0, std=0.02)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        cache: DecodingCache | None = None,
        last_only: bool = False,
        positions: Tensor | None = None,
        lengths: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Logits for every position, and the mean cross-entropy when targets are given.

        Args:
            idx: (B, T) token ids. T may exceed `block_size` for every scheme but `learned`.
            targets: (B, T) next-token ids; positions holding -1 are left out of the loss.
            cache: what decoding keeps of the tokens before `idx` (`new_cache`); the new tokens sit at
                each row's next positions and are added to it.
            last_only: logits for the last position only, (B, 1, padded_vocab_size), as generation needs.
            lengths: (B,) how many of each row's tokens are real, the rest padding on the right: no real
                token attends to padding. Into an empty cache or without one.
            positions: (B, T) increasing positions of each row (randomized positions, Ruoss et al. 2023);
                default 0..T-1. Not with a cache; the scheme's tables must cover them (`pe.reserve`).

        Returns:
            logits (B, T, padded_vocab_size) and the loss (a scalar) or None; with targets and
            `config.chunked_loss`, None and the loss (the logits are never formed whole).
        """
        x = self._hidden(idx, cache, positions=positions, lengths=lengths)  # (B, T, C)
        if targets is not None and self.config.chunked_loss and not last_only:
            return None, linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        if last_only:
            x = x[:, -1:] if lengths is None else x[torch.arange(x.size(0), device=x.device), lengths - 1, None]
        logits = self.lm_head(x)  # (B, T or 1, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def hidden_states(self, idx: Tensor) -> Tensor:
        """The final-LayerNorm states (B, T, C), for evaluations that project only some of them, or in chunks."""
        return self._hidden(idx, None)

    @torch.no_grad()
    def attention_weights(self, idx: Tensor, visit: Callable[[int], WeightsHook | None]) -> Tensor:
        """Logits (B, T, padded_vocab_size) of a forward pass on the kernel that forms the attention weights,
        handing each layer's weights to `visit(layer)` (a hook, or None to skip the layer) in chunks of query
        rows. Call it on a model in eval mode.
        """
        return self.lm_head(self._hidden(idx, None, visit))

    def switch(self, config: GPTConfig) -> None:
        """Become a model of `config` in place (DroPE; GPT-2 into another scheme). Only the fields of role `SWITCH` may
        differ; a rebuilt scheme or log-length scaling has fresh parameters, every other parameter stays the same
        object, so an optimizer keeps its state for them."""
        switchable = config.fields_with(Role.SWITCH)
        fixed = [f for f, v in config.to_dict().items() if f not in switchable and getattr(self.config, f) != v]
        if fixed:
            raise ValueError(
                f"A model can switch its position scheme, mask, log-length scaling and kernel, not {', '.join(fixed)} "
                "(the weights would change shape or meaning)."
            )
        old_kinds, kinds = self.kinds, layer_kinds(config)
        self._take_schemes(config, kinds)
        self.config, self.kinds = config, kinds
        for kind, before in zip(kinds, old_kinds, strict=True):
            for i in kind.layers:
                self.blocks[i].attn.reconfigure(before.config, kind.config)
        for memo in self._kernel_memos.values():
            memo.clear()  # block masks of the old mask

    def switch_replaces_parameters(self, config: GPTConfig) -> bool:
        """Whether `switch(config)` would replace parameters (a scheme's own, a learned log-length
        scale) by new ones: an optimizer must then be given them, and DDP or FSDP cannot follow."""
        kinds = layer_kinds(config)
        pe, own = self._schemes(config, kinds)
        kept = [s for s in (pe, *own.values()) if isinstance(s, PositionEncoding)]
        dropped = [s for s in (self.pe, *self.kind_pe.values()) if not any(s is k for k in kept)]
        with torch.device("meta"):
            built = [build_positions(s) for s in (pe, *own.values()) if isinstance(s, GPTConfig)]
        if any(True for scheme in (*dropped, *built) for _ in scheme.parameters()):
            return True
        pairs = zip(self.kinds, kinds, strict=True)
        attns = [(self.blocks[i].attn, before, kind) for before, kind in pairs for i in kind.layers]
        return any(attn.reconfigure_replaces_parameters(before.config, kind.config) for attn, before, kind in attns)

    @property
    def rescalable(self) -> bool:
        """Whether `rescaled` applies: a scheme whose angles stretch (RoPE) in every layer that reads positions, at
        one base (a layout whose kinds turn at several is not, as Gemma 3 scales its global layers only)."""
        every = all(self.pe_of(kind).rescalable or not self.pe_of(kind).uses_positions for kind in self.kinds)
        return every and len(self.rope_bases) == 1  # none rescalable: 0

    @property
    def rope_bases(self) -> list[float]:
        """The bases its rescalable layers turn at (RoPE's `rope_base`), each once, in order."""
        return sorted({kind.config.rope_base for kind in self.kinds if self.pe_of(kind).rescalable})

    def rescaled(self, scaling: str, factor: float) -> GPT:
        """A view of this model, sharing every parameter and buffer, with its scheme's angles stretched
        (`rope_scaling`: PI, NTK or YaRN at evaluation); for a `rescalable` model only."""
        if not self.rescalable:
            raise ValueError(
                f"pos_encoding={self.config.pos_encoding!r} (in every layer, at one base) has no scaling; RoPE has "
                "(PI, NTK, YaRN): evaluate this model without rope_scaling."
            )
        view = copy.copy(self)  # a shallow copy: the same modules, parameters and buffers
        view._modules = dict(self._modules)  # ... but its own table of them, so that its schemes are its own
        config = dataclasses.replace(self.config, rope_scaling=scaling, rope_scaling_factor=float(factor))
        # only the schemes whose settings change are rebuilt (RoPE's: a table stays); a kind that pins its own
        # rope_scaling keeps its scheme as it was (OLMo 3: YaRN on the global layers only)
        kinds = layer_kinds(config)
        view._take_schemes(config, kinds)
        view.config, view.kinds = config, kinds
        return view

    def _schemes(
        self, config: GPTConfig, kinds: list[LayerKind]
    ) -> tuple[PositionEncoding | GPTConfig, dict[str, PositionEncoding | GPTConfig]]:
        """The schemes this model would attend with as a model of `config` whose layers are `kinds` (aligned with its
        own): the model's, and each kind's own (a kind missing attends with the model's), each a scheme that stays,
        with its parameters, or the config to build one from. The model's stays while its settings do. A kind keeps
        the scheme it attended with while its settings stay, unless that is the model's and stays the model's; else
        a kind whose scheme is not the model's gets one built anew. The one rule for a model built, switched
        (`switch`) or rescaled (`rescaled`)."""
        pe = self.pe if not scheme_differs(self.config, config) else config
        own: dict[str, PositionEncoding | GPTConfig] = {}
        for kind, before in zip(kinds, self.kinds, strict=True):
            scheme = self.pe_of(before)
            if scheme is not pe and not scheme_differs(before.config, kind.config):
                own[str(kind.name)] = scheme
            elif scheme_differs(config, kind.config):
                own[str(kind.name)] = kind.config
        return pe, own

    def _take_schemes(self, config: GPTConfig, kinds: list[LayerKind]) -> None:
        """Attend with the schemes `_schemes` gives, those to build built on the model's device, in its dtype."""
        pe, own = self._schemes(config, kinds)
        weight = self.wte.weight

        def built(source: PositionEncoding | GPTConfig) -> PositionEncoding:
            if isinstance(source, PositionEncoding):
                return source
            return build_positions(source).to(device=weight.device, dtype=weight.dtype)

        self.pe, self.kind_pe = built(pe), nn.ModuleDict({name: built(s) for name, s in own.items()})

    def reserve(self, length: int) -> None:
        """Grow every position scheme's tables (the model's, each kind's) to `length` positions now."""
        for pe in (self.pe, *self.kind_pe.values()):
            pe.reserve(length)

    @property
    def uses_positions(self) -> bool:
        """Whether any scheme of the model reads positions (random positions train none that does not)."""
        return any(pe.uses_positions for pe in (self.pe, *self.kind_pe.values()))

    def pe_of(self, kind: LayerKind) -> PositionEncoding:
        """The position scheme the layers of `kind` attend with: the model's, or the kind's own."""
        return self.kind_pe[kind.name] if kind.name is not None and kind.name in self.kind_pe else self.pe

    @property
    def kind_index(self) -> list[int]:
        """Each layer's kind, as its index in `kinds` (those of the layers, `model.layout`; one without a layout)."""
        return [j for i in range(self.config.n_layer) for j, kind in enumerate(self.kinds) if i in kind.layers]

    @property
    def kind_of(self) -> list[LayerKind]:
        """Each layer's kind, in layer order."""
        return [self.kinds[j] for j in self.kind_index]

    def _hidden(
        self,
        idx: Tensor,
        cache: DecodingCache | None,
        visit: Callable[[int], WeightsHook | None] | None = None,
        positions: Tensor | None = None,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """The final-LayerNorm states (B, T, C) (with `visit`: see `attention_weights`)."""
        B, T = idx.shape
        if positions is not None and (cache is not None or positions.shape != idx.shape):
            raise ValueError(f"positions must be (B, T) = {tuple(idx.shape)} like idx, and cannot go with a cache.")
        if lengths is not None and not torch.compiler.is_compiling():  # one read per prefill, never in a graph
            shortest, longest = torch.stack(torch.aminmax(lengths)).tolist() if lengths.numel() else (0, 0)
            if lengths.shape != (B,) or shortest < 1 or longest > T:
                raise ValueError(f"lengths must be (B,) = ({B},) counts in 1..{T}, got {tuple(lengths.shape)} in "
                                 f"{shortest}..{longest}.")  # fmt: skip
        writes = cache.begin(B, T, lengths, idx.device) if cache is not None else []  # each kind's view of the step
        first = writes[0] if writes else None
        decoding = first is not None and not first.prefill
        if decoding:  # each row at its own positions, over the keys the cache holds (and the tables reserved)
            positions = first.positions
        elif (limit := self.pe.max_positions) is not None and T > limit:  # positions 0..T-1, past a table's
            unlimited = [name for name, scheme in SCHEMES.items() if scheme.longest(self.config) is None]
            raise ValueError(
                f"pos_encoding={self.config.pos_encoding!r} can encode at most {limit} positions "
                f"(block_size={self.config.block_size}) but got a sequence of {T} tokens. Crop "
                f"the input to its last {limit} tokens, or use a scheme without that limit ({', '.join(unlimited)})."
            )
        x = self.drop(self.pe.embed(self.wte(idx), positions))  # (B, T, C)
        dropout = self.training and self.config.dropout > 0
        float64 = x.dtype == torch.float64 and not torch.is_autocast_enabled(idx.device.type)
        needs_grad = x.requires_grad
        plans: list[Plan | None] = [None for _ in self.kinds]  # each kind's, made at its first layer
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for i, j in enumerate(self.kind_index):
            kind = self.kinds[j]
            pe, plan = self.pe_of(kind), plans[j]
            if plan is None or pe.bias_layers > 1:  # its context: once for the kind, or per layer for a bias per layer
                if plan is None:  # the kind's kernel and place in the cache, for all its layers
                    kernel = self.kernel(
                        idx.device, dropout, needs_grad, decoding, weights=visit is not None, float64=float64, kind=kind
                    )
                    write = writes[j] if writes else None
                    placement = Placement(T, self.config.n_head, idx.device, positions,
                                          write.k_pos if decoding else None, pe.rotation(T, positions))  # fmt: skip
                    plan = Plan(kernel, None, placement, cache_write=write)
                bias = pe.bias(i) if pe.terms else None  # from the parameters as they are now
                if bias is not None:  # and what the scheme declares of it
                    bias = dataclasses.replace(bias, relative=pe.relative, learned=pe.learned_bias)
                memo, settings = self._kernel_memos[type(plan.kernel)], kind.attention.kernel_settings(kind.config)
                context = plan.kernel.context(bias, kind.mask, plan.placement, memo, **settings)
                plan = plans[j] = dataclasses.replace(plan, context=context)
            layer_plan = plan if visit is None else dataclasses.replace(plan, on_weights=visit(i))
            if recompute:
                x = checkpoint(self.blocks[i], x, pe, layer_plan, use_reentrant=False)
            else:
                x = self.blocks[i](x, pe, layer_plan, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.commit(writes)
        return self.ln_f(x)

    def kernel(
        self, device: torch.device, dropout: bool, needs_grad: bool, decoding: bool = False, weights: bool = False,
        float64: bool = False, kind: LayerKind | None = None,
    ) -> Kernel:  # fmt: skip
        """The kernel `config.attn_backend` resolves to for a forward pass on `device` with these needs (with
        `weights`: the one that forms the weights; `float64`: computed in float64) for the layers of `kind` (None:
        the first kind's, every layer's without a layout)."""
        kind = kind or self.kinds[0]
        function, c = kind.attention, kind.config
        needs = function.needs(
            self.pe_of(kind), kind.mask, SCORES[c.attn_score], device,
            dropout_active=dropout, needs_grad=needs_grad, decoding=decoding,
            head_size=function.kernel_head_size(c.head_dim), float64=float64, asked=function.layer_terms(c),
        )  # fmt: skip
        if weights:
            return function.weights_kernel(needs)
        return function.choose_kernel(c.attn_backend, needs, device)

    def new_cache(self, capacity: int, batch: int | None = None, longest: int | None = None) -> DecodingCache:
        """What decoding keeps: each kind's part (`Attention.new_cache`) and one position per row, allocated now for
        `batch` rows when given. Position tables grow now to the `longest` position decoding will reach (default
        `capacity`): a decode step never grows them (a rolling cache decodes past its capacity: give it `longest`)."""
        self.reserve(longest or capacity)
        parts = [kind.attention.new_cache(kind.config, kind.mask, capacity, len(kind.layers)) for kind in self.kinds]
        cache = DecodingCache(parts, self.kind_index)
        if batch is not None:
            cache.allocate(batch, self.wte.weight.dtype, self.wte.weight.device)
        return cache

    def constant_memory(self) -> bool:
        """Whether what decoding keeps stays the same size however long it runs (every kind's cache)."""
        return all(kind.attention.constant_memory(kind.config, kind.mask) for kind in self.kinds)

    def num_params(self, exclude_embeddings: bool = True) -> int:
        """Number of parameters (tied weights counted once); `exclude_embeddings` leaves out the scheme's
        lookup tables, not the token embedding, which the tied head uses as a matmul (nanoGPT's N)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(p.numel() for pe in (self.pe, *self.kind_pe.values()) for p in pe.lookup_parameters())
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at context `seq_len`: 6N and each layer's mixing (`Attention.mixing_flops`: 12 H Q T
        for softmax attention, T the keys a token sees, PaLM appendix B), for MFU; a layout sums its layers'."""
        mixing = (k.attention.mixing_flops(k.config, k.mask, seq_len) * len(k.layers) for k in self.kinds)
        return 6 * self.num_params() + sum(mixing)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        max_context: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend each row of `idx` (B, T) by `max_new_tokens` tokens (`model.generation.stream`); (B, T + new).
        The options in nanoGPT's order first, so that its positional calls work."""
        steps = stream(self, idx, max_new_tokens, temperature, top_k, top_p, use_cache, max_context, generator)
        return torch.cat([idx, *steps], dim=1)
