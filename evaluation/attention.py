"""`attention_maps.py`: where attention goes, from the weights `GPT.attention_weights` recomputes in float32 on
the eager reference kernel, accumulated a chunk of query rows at a time (no (layers, heads, T, T) tensor):
heatmaps for a short prompt; mass by distance, entropy and sink mass by query position, and the sink rate, at
long contexts (docs/attention_maps.md; figures in `evaluation.report`). Each file is written whole,
results.json last (it lists the figures of the run that wrote it).

The sink rate follows Gu et al.'s `compute_attention_sink` (github.com/sail-sg/Attention-Sink,
eval_sink_open_source.py at e0d3b0e477bad52b620d0d9e063ac2497fed727f): alpha_0, the first token's weight
averaged over all T queries of a window (its divisor ignores the mask), is thresholded per window with a
strict `>`, then the indicators are averaged. Linear attention with RoPE has signed weights: its entropy
is that of |w| normalised per row.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from posgpt.core.cli import Command
from posgpt.core.device import pick_device
from posgpt.core.errors import ConfigError, UserError
from posgpt.core.files import atomic_write_bytes
from posgpt.evaluation.checkpoint import (
    EvalData,
    LoadedCheckpoint,
    check_output_dir,
    default_labels,
    load_checkpoint,
    load_texts,
    results_header,
)
from posgpt.evaluation.sampling import prompt_text
from posgpt.model.gpt import GPT
from posgpt.model.kernels import WeightsHook

SINK_RATE_THRESHOLD = 0.3
"""Gu et al.'s epsilon: a head with alpha_0 above it in a window is a sink in that window."""
SINK_RATE_DEFINITION = "per-window alpha_0 > threshold (Gu et al. 2025)"
"""Marks Gu et al.'s metric: summaries from before issue 33 thresholded alpha_0 averaged over windows."""
PER_OCTAVE = 4
"""Buckets per doubling of distance or position in the summaries (the plots are log-x)."""


def log_edges(n: int, per_octave: int = PER_OCTAVE) -> list[int]:
    """Bucket edges over 0..n-1, log-spaced: [0, 1, 2, ..., 7, 9, 11, 13, 15, 19, 22, ...] (each
    integer at first, `per_octave` buckets per doubling later); the last edge is n."""
    edges = {0, n}
    x = 1.0
    while x < n:
        edges.add(int(x))
        x *= 2 ** (1 / per_octave)
    return sorted(edges)


def bucket_means(values: np.ndarray, edges: list[int]) -> np.ndarray:
    """Mean of `values` (..., n) over each bucket [edges[b], edges[b + 1])."""
    return np.stack([values[..., lo:hi].mean(-1) for lo, hi in zip(edges[:-1], edges[1:], strict=True)], axis=-1)


def distance_sums(weights: Tensor, rows: slice) -> Tensor:
    """sum over batch and queries of the weight at each distance d = i - j: (H, Tk) from weights
    (B, H, rows, Tk) of the queries at positions `rows` (keys at 0..Tk-1)."""
    q_pos = torch.arange(rows.start, rows.stop, device=weights.device)
    distance = q_pos[:, None] - torch.arange(weights.size(-1), device=weights.device)[None, :]  # (rows, Tk)
    w = weights.sum(0).masked_fill(distance < 0, 0.0)  # (H, rows, Tk): keys after the query carry nothing
    sums = w.new_zeros(w.size(0), weights.size(-1))
    return sums.index_add_(1, distance.clamp(min=0).flatten(), w.flatten(1))


def row_entropy(weights: Tensor) -> Tensor:
    """Entropy (nats) of each row of weights (..., Tk): -sum p log p with p = |w| / sum |w|."""
    p = weights.abs()
    p = p / p.sum(-1, keepdim=True)
    return -torch.special.xlogy(p, p).sum(-1)


class AttentionStats:
    """Accumulates the statistics of every layer over windows of one length; `hook(layer)` is the
    `visit` of `GPT.attention_weights`."""

    def __init__(self, n_layer: int, n_head: int, length: int, sink_tokens: int, device: torch.device) -> None:
        self.length, self.sink_tokens, self.windows = length, sink_tokens, 0
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        # summed over windows, (layers, H, length): weight by distance, entropy and sink mass by query position
        self.distance, self.entropy, self.sink = (zeros(n_layer, n_head, length) for _ in range(3))
        # (layers, H): alpha_0 summed over windows, and the windows in which it passed the threshold
        self.first_mass, self.sink_windows = zeros(n_layer, n_head), zeros(n_layer, n_head)
        # per layer, (B, H): first-token weight over the batch's query rows seen so far (alpha_0 once all have come)
        self.pending: list[Tensor | None] = [None] * n_layer
        self.pending_rows = [0] * n_layer

    def hook(self, layer: int) -> WeightsHook:
        def add(rows: slice, weights: Tensor) -> None:
            self.distance[layer] += distance_sums(weights, rows).double()
            self.entropy[layer, :, rows] += row_entropy(weights).sum(0).double()
            self.sink[layer, :, rows] += weights[..., : self.sink_tokens].sum(-1).sum(0).double()
            first = weights[..., 0].double().sum(-1)  # (B, H): these rows' weight on the first key
            pending = self.pending[layer]
            self.pending[layer] = first if pending is None else pending + first
            self.pending_rows[layer] += rows.stop - rows.start
            if self.pending_rows[layer] == self.length:  # every query of these windows seen: alpha_0 is known
                alpha0 = self.pending[layer] / self.length  # (B, H), the mean over all T queries (Gu et al.)
                self.first_mass[layer] += alpha0.sum(0)
                self.sink_windows[layer] += (alpha0 > SINK_RATE_THRESHOLD).sum(0)
                self.pending[layer], self.pending_rows[layer] = None, 0

        return add

    def add_windows(self, model: GPT, windows: Tensor) -> None:
        """Run `windows` (B, length) token ids through `model`, adding their attention to the sums."""
        model.attention_weights(windows, self.hook)
        self.windows += windows.size(0)

    def summary(self) -> dict[str, Any]:
        """Per layer and head, bucketed means over windows and queries ([layer][head][bucket]), and the sink rate."""
        n = self.length
        edges = log_edges(n)
        queries_at = (n - np.arange(n)) * self.windows  # queries that have a key d back, over windows
        distance = self.distance.cpu().numpy() / queries_at
        entropy = self.entropy.cpu().numpy() / self.windows
        sink = self.sink.cpu().numpy() / self.windows
        if any(self.pending_rows):
            raise RuntimeError("A batch of windows was summarised before all its query rows had been added.")
        first = self.first_mass.cpu().numpy() / self.windows  # (layers, heads): alpha_0's mean, never thresholded
        sinks = self.sink_windows.cpu().numpy() / self.windows  # (layers, heads): the share of sink windows
        rate = {"definition": SINK_RATE_DEFINITION, "threshold": SINK_RATE_THRESHOLD,
                "per_layer": rounded(sinks.mean(-1)), "model": float(f"{sinks.mean():.6g}"),
                "per_head": rounded(sinks), "first_token_mass": rounded(first)}  # fmt: skip
        return {
            "windows": self.windows,
            "sink_tokens": self.sink_tokens,
            "sink_rate": rate,
            "distance": {"edges": edges, "mean_weight": rounded(bucket_means(distance, edges))},
            "position": {
                "edges": edges,
                "entropy": rounded(bucket_means(entropy, edges)),
                "sink_mass": rounded(bucket_means(sink, edges)),
            },
        }


def rounded(values: np.ndarray, digits: int = 6) -> list:
    """`values` as nested lists of floats of `digits` significant digits (results.json stays readable)."""
    return np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[float])(values).tolist()


WINDOW_TOKENS = 16384
"""Tokens per forward pass of the long-context statistics."""


def runs_at(model: GPT, length: int) -> bool:
    limit = model.pe.max_positions
    return limit is None or length <= limit


def long_context_stats(
    labels: list[str],
    loaded: list[LoadedCheckpoint],
    texts: list[tuple[np.ndarray, dict]],
    lengths: list[int],
    tokens: int,
    sink_tokens: int,
    device: torch.device,
    progress: bool,
) -> list[dict[str, Any]]:
    """The statistics of every checkpoint (its label, its text's tokens and record as `load_texts` gives them) at
    every length its model can run, on `device`, on the first max(1, tokens // length) non-overlapping windows."""
    plan = [
        (label, ckpt, text, length, min(max(1, tokens // length), len(text) // length))
        for length in lengths
        for label, ckpt, (text, _) in zip(labels, loaded, texts, strict=True)
        if runs_at(ckpt.model, length)
    ]
    entries = []
    bar_on = progress and sys.stderr.isatty()  # a bar in a log file is a carriage-return flood
    with tqdm(total=sum(p[-1] for p in plan), unit="window", disable=not bar_on, dynamic_ncols=True) as bar:
        for label, ckpt, text, length, count in plan:
            bar.set_description(f"attention {label} L={length}")
            model = ckpt.model.to(device).eval()
            stats = AttentionStats(model.config.n_layer, model.config.n_head, length, sink_tokens, device)
            batch = max(1, WINDOW_TOKENS // length)
            for start in range(0, count, batch):  # the first `count` non-overlapping windows
                n = min(batch, count - start)
                rows = text[start * length : (start + n) * length].astype(np.int64).reshape(n, length)
                stats.add_windows(model, torch.from_numpy(rows).to(device))
                bar.update(n)
            entries.append({"length": length, "label": label, "ckpt": ckpt.path,
                            "train_length": model.config.block_size, "summary": stats.summary()})  # fmt: skip
    return entries


def prompt_weights(model: GPT, idx: Tensor) -> list[Tensor]:
    """Every layer's weights (H, T, T) for one short prompt `idx` (1, T), for heatmaps."""
    chunks: list[list[Tensor]] = [[] for _ in model.blocks]

    def visit(layer: int) -> WeightsHook:
        return lambda rows, weights: chunks[layer].append(weights[0].cpu())

    model.attention_weights(idx, visit)
    return [torch.cat(c, dim=1) for c in chunks]


def visible_keys(model: GPT, length: int) -> Tensor:
    """(T, T) bool: which keys each query may attend to."""
    pos = torch.arange(length)
    return model.mask.dense(pos, pos)


FORMAT = "posgpt-attention/1"
log = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = 64
"""Longest prompt drawn as a heatmap: past it the token labels cannot be read."""


@dataclass
class MapsConfig:
    """Which checkpoints to look inside, and how."""

    ckpt: list[str]
    """Checkpoints written by train.py (several: their figures share axes, one colour each)."""
    labels: list[str] | None = None
    """A name per checkpoint (default: its run directory); a shared name marks seeds of one model, averaged."""
    out: str = "attention_maps"
    """Directory for the figures and results.json (created if needed)."""
    prompt: str | None = None
    """A short text (up to 64 tokens), or @FILE: per checkpoint, heatmaps of every head and of the head means."""
    layers: list[int] | None = None
    """Layers to draw heatmaps of (default: all), counted from 0."""
    heads: list[int] | None = None
    """Heads to draw in each heatmap grid (default: all), counted from 0."""
    lengths: list[int] | None = None
    """Context lengths of the long-context statistics (mass by distance, entropy, sink mass), e.g. [256, 4096]."""
    text: str | None = None
    """Text file of the long-context statistics (default: each checkpoint's validation split; or --data.dir)."""
    data: EvalData = field(default_factory=EvalData)
    """The text of the long-context statistics, as evaluate.py's --eval_data (input = --text)."""
    tokens: int = 8192
    """Tokens averaged over at each length: max(1, tokens // length) windows from the start of the text."""
    sink_tokens: int = 4
    """The first tokens whose attention mass is reported (attention sinks)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...; always float32 (the reference)."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        if not self.prompt and not self.lengths:
            raise ValueError("Nothing to draw: pass --prompt TEXT (heatmaps) and/or --lengths 256 1024 "
                             "(attention by distance, entropy and sinks at long contexts).")  # fmt: skip
        if self.lengths is not None:
            if not self.lengths or any(n < 1 for n in self.lengths):
                raise ValueError(f"lengths must be positive integers, got {self.lengths!r}.")
            self.lengths = sorted(set(self.lengths))
        if self.text:
            if self.data.input and self.data.input != self.text:
                raise ValueError("Pass the text once: --text FILE or --data.input FILE.")
            self.data = dataclasses.replace(self.data, input=self.text)
        if self.tokens < 1 or self.sink_tokens < 0:
            raise ValueError("tokens must be positive and sink_tokens at least 0.")
        if self.labels is not None and len(self.labels) != len(self.ckpt):
            raise ValueError(f"--labels gives {len(self.labels)} names for {len(self.ckpt)} checkpoints.")
        if any(i < 0 for i in (self.layers or []) + (self.heads or [])):
            raise ValueError("Layer and head indices count from 0.")


def run(cfg: MapsConfig) -> list[Path]:
    """Everything `cfg` asks for, written under `cfg.out` (every input checked first); the files written."""
    check_output_dir(cfg.out)
    device = pick_device(cfg.device)
    loaded = [load_checkpoint(path, cfg.data.tiktoken_ranks) for path in cfg.ckpt]
    labels = cfg.labels or default_labels(cfg.ckpt)
    for ckpt in loaded:
        _check_indices(ckpt, cfg)
        ckpt.model.to(device).eval()
    prompts = [_prompt_ids(c, cfg.prompt) for c in loaded] if cfg.prompt else []
    texts = []
    if cfg.lengths:
        for length in cfg.lengths:  # none reaching it is an error; some that do not are left out, with a line
            if not any(runs_at(c.model, length) for c in loaded):
                _check_length(loaded[0], length, "--lengths")
            for label, ckpt in zip(labels, loaded, strict=True):
                if not runs_at(ckpt.model, length):
                    log.info("%s: left out at length %d (positions up to %d)", label, length,
                             ckpt.model.pe.max_positions)  # fmt: skip
        texts = load_texts(loaded, cfg.data, cfg.lengths[-1])
    out = Path(cfg.out)
    files: dict[Path, bytes] = {}
    doc: dict[str, Any] = {"format": FORMAT, **results_header(device, torch.float32), "config": dataclasses.asdict(cfg)}
    doc["note"] = "weights recomputed on the eager reference kernel, in float32 (fused kernels never form them)"
    if cfg.prompt:  # a folder per checkpoint: its label made a file name, seeds told apart (name#2)
        safe = ["".join(c if c.isalnum() or c in "-_.+" else "_" for c in label) or "model" for label in labels]
        folders = default_labels([str(Path(name) / "last.ckpt") for name in safe])
        doc["prompts"] = [
            _draw_prompt(label, c, ids, cfg, out / folder, files)
            for label, c, ids, folder in zip(labels, loaded, prompts, folders, strict=True)
        ]
    if cfg.lengths:
        from posgpt.evaluation.report import stats_pngs

        doc["lengths"] = long_context_stats(labels, loaded, texts, cfg.lengths, cfg.tokens, cfg.sink_tokens, device,
                                            cfg.progress)  # fmt: skip
        files.update({out / name: png for name, png in stats_pngs(doc["lengths"]).items()})
    doc["files"] = sorted(path.relative_to(out).as_posix() for path in files)
    files[out / "results.json"] = json.dumps(doc, indent=1, allow_nan=False).encode()
    for path, payload in files.items():  # results.json last: present, it lists figures that are
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, payload)
    return list(files)


def _check_length(ckpt: LoadedCheckpoint, length: int, what: str) -> None:
    if not runs_at(ckpt.model, length):
        limit = ckpt.model.pe.max_positions
        raise ConfigError(
            f"{ckpt.path} has {ckpt.model.config.pos_encoding} positions, which exist up to {limit} tokens; "
            f"{what} asks for {length}. Use lengths up to {limit} for it, or leave it out."
        )


def _check_indices(ckpt: LoadedCheckpoint, cfg: MapsConfig) -> None:
    for what, asked, count in (("layer", cfg.layers, ckpt.model.config.n_layer),
                               ("head", cfg.heads, ckpt.model.config.n_head)):  # fmt: skip
        unknown = [i for i in asked or [] if i >= count]
        if unknown:
            raise ConfigError(
                f"{ckpt.path} has {count} {what}s (0..{count - 1}); there is no {what} {unknown[0]}. "
                f"Pass --{what}s within 0..{count - 1}."
            )


def _prompt_ids(ckpt: LoadedCheckpoint, prompt: str) -> list[int]:
    ids = ckpt.tokenizer.encode(prompt_text(prompt))
    if not ids:
        raise ConfigError("The prompt is empty: pass --prompt TEXT with at least one token.")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ConfigError(
            f"The prompt is {len(ids)} tokens for {ckpt.path}; a heatmap is readable up to {MAX_PROMPT_TOKENS}. "
            "Shorten it, or pass --lengths to see attention at long contexts."
        )
    _check_length(ckpt, len(ids), "the prompt")
    return ids


def _draw_prompt(
    label: str, ckpt: LoadedCheckpoint, ids: list[int], cfg: MapsConfig, folder: Path, files: dict[Path, bytes]
) -> dict[str, Any]:
    """The heatmaps of one checkpoint on the prompt, into `folder`; the plotted numbers (matplotlib imported to
    draw, not for --help)."""
    from posgpt.evaluation.report import heatmaps_figure, png_bytes, printable

    model = ckpt.model
    idx = torch.tensor([ids], device=model.wte.weight.device)
    weights = prompt_weights(model, idx)  # per layer (H, T, T)
    visible = visible_keys(model, len(ids))
    tokens = [printable(ckpt.tokenizer.decode([i])) for i in ids]
    layers = cfg.layers if cfg.layers is not None else list(range(model.config.n_layer))
    heads = cfg.heads if cfg.heads is not None else list(range(model.config.n_head))
    name = f"{label} ({model.config.pos_encoding})"
    cols = math.ceil(math.sqrt(len(heads)))
    for layer in layers:
        panels = [(f"head {head}", weights[layer][head]) for head in heads]
        figure = heatmaps_figure(panels, visible, tokens, f"{name}: layer {layer}, weights per head", cols)
        files[folder / f"layer{layer}.png"] = png_bytes(figure)
    means = [(f"layer {layer}, mean over heads", weights[layer][heads].mean(0)) for layer in layers]
    figure = heatmaps_figure(means, visible, tokens, f"{name}: mean over heads", min(len(means), 4))
    files[folder / "layers_mean.png"] = png_bytes(figure)
    shown = {str(layer): rounded(weights[layer][heads].masked_fill(~visible, 0.0).numpy(), 5) for layer in layers}
    return {"label": label, "ckpt": ckpt.path, "tokens": tokens, "ids": ids, "weights": shown, "heads": heads}


def attention_main(cfg: MapsConfig) -> None:
    try:
        paths = run(cfg)
    except OSError as error:
        raise UserError(f"cannot write the figures to {cfg.out}: {error.strerror or error}.") from error
    print(f"wrote {len(paths)} files to {cfg.out}: " + ", ".join(str(p) for p in paths[:8])
          + (" ..." if len(paths) > 8 else ""))  # fmt: skip


COMMAND = Command(
    "attention_maps.py",
    MapsConfig,
    attention_main,
    """Look inside trained models: --ckpt A.ckpt --prompt "ROMEO:" --out maps.

With --prompt (up to 64 tokens): per checkpoint, one PNG per layer with a grid of heads (query x key
heatmaps) and one of every layer averaged over heads. With --lengths 256 1024 4096: per length, attention
mass against distance, attention entropy and the mass on the first tokens against query position, per
layer, the training length marked. results.json holds every number plotted. The weights are recomputed in
float32 on the eager reference kernel from the checkpoint's parameters: the fused kernels that train and
sample never form them.""",
    aliases={"eval_data.": "data."},
)
