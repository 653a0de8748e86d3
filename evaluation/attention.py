"""`attention_maps.py` (`posgpt attention`): where attention goes in trained models, from the weights
`GPT.attention_weights` recomputes in float32 on the eager reference kernel: heatmaps for a short prompt, and
at long contexts the statistics of `evaluation.attention_stats` (docs/attention_maps.md; figures in
`evaluation.figures`). Each file is written whole, results.json last (it lists the figures of the run that
wrote it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posgpt.core.cli import Command
from posgpt.core.device import pick_device
from posgpt.core.errors import ConfigError, UserError
from posgpt.core.files import atomic_write_bytes
from posgpt.evaluation.attention_stats import long_context_stats, rounded, runs_at
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

FORMAT = "posgpt-attention/1"
log = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = 64
"""Longest prompt drawn as a heatmap: past it the token labels cannot be read."""


def prompt_weights(model: GPT, idx: Tensor) -> list[Tensor]:
    """Every layer's weights (H, T, T) for one short prompt `idx` (1, T), for heatmaps."""
    chunks: list[list[Tensor]] = [[] for _ in model.blocks]

    def visit(layer: int) -> WeightsHook:
        return lambda rows, weights: chunks[layer].append(weights[0].cpu())

    model.attention_weights(idx, visit)
    return [torch.cat(c, dim=1) for c in chunks]


def visible_keys(model: GPT, length: int, layer: int = 0) -> Tensor:
    """(T, T) bool: which keys each query of `layer` may attend to (a layout: its kind's mask)."""
    pos = torch.arange(length)
    return model.kind_of[layer].mask.dense(pos, pos)


def layer_name(model: GPT, layer: int) -> str:
    """'layer 3', with its kind in a layout: 'layer 3 (global)'."""
    kind = model.kind_of[layer].name
    return f"layer {layer}" + (f" ({kind})" if kind else "")


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
        for what, asked, count in (("layer", cfg.layers, ckpt.model.config.n_layer),
                                   ("head", cfg.heads, ckpt.model.config.n_head)):  # fmt: skip
            if unknown := [i for i in asked or [] if i >= count]:
                raise ConfigError(
                    f"{ckpt.path} has {count} {what}s (0..{count - 1}); there is no {what} {unknown[0]}. "
                    f"Pass --{what}s within 0..{count - 1}."
                )
        ckpt.model.to(device).eval()
    prompts = [_prompt_ids(c, cfg.prompt) for c in loaded] if cfg.prompt else []
    for length in cfg.lengths or []:  # none reaching it is an error; some that do not are left out, with a line
        short = [(label, c) for label, c in zip(labels, loaded, strict=True) if not runs_at(c.model, length)]
        if len(short) == len(loaded):
            _check_length(loaded[0], length, "--lengths")
        for label, ckpt in short:
            log.info("%s: left out at length %d (positions up to %d)", label, length, ckpt.model.pe.max_positions)
    texts = load_texts(loaded, cfg.data, cfg.lengths[-1]) if cfg.lengths else []
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
        from posgpt.evaluation.figures import stats_pngs  # matplotlib: imported to draw, not for --help

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
    """The heatmaps of one checkpoint on the prompt, into `folder`; the plotted numbers."""
    from posgpt.evaluation.figures import heatmaps_figure, png_bytes, printable  # matplotlib: not for --help

    model = ckpt.model
    weights = prompt_weights(model, torch.tensor([ids], device=model.wte.weight.device))  # per layer (H, T, T)
    tokens = [printable(ckpt.tokenizer.decode([i])) for i in ids]
    layers = cfg.layers if cfg.layers is not None else list(range(model.config.n_layer))
    heads = cfg.heads if cfg.heads is not None else list(range(model.config.n_head))
    name = f"{label} ({model.config.pos_encoding})"
    cols = math.ceil(math.sqrt(len(heads)))
    visible = {layer: visible_keys(model, len(ids), layer) for layer in layers}
    for layer in layers:
        panels = [(f"head {head}", weights[layer][head]) for head in heads]
        title = f"{name}: {layer_name(model, layer)}, weights per head"
        files[folder / f"layer{layer}.png"] = png_bytes(heatmaps_figure(panels, visible[layer], tokens, title, cols))
    means = [(f"{layer_name(model, layer)}, mean over heads", weights[layer][heads].mean(0)) for layer in layers]
    shared = torch.stack([visible[layer] for layer in layers]).any(0)  # blank where no layer shown sees the key
    figure = heatmaps_figure(means, shared, tokens, f"{name}: mean over heads", min(len(means), 4))
    files[folder / "layers_mean.png"] = png_bytes(figure)
    shown = {
        str(layer): rounded(weights[layer][heads].masked_fill(~visible[layer], 0.0).numpy(), 5) for layer in layers
    }
    kinds = {str(layer): model.kind_of[layer].name for layer in layers if model.kind_of[layer].name}
    return {"label": label, "ckpt": ckpt.path, "tokens": tokens, "ids": ids, "weights": shown, "heads": heads,
            **({"kinds": kinds} if kinds else {})}  # fmt: skip


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
