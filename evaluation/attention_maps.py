"""The logic behind `attention_maps.py`: heatmaps for a short prompt and where attention goes at long
contexts (numbers in `evaluation.attention`, figures in `evaluation.attention_figures`). Each file is
written whole, results.json last (it lists the figures of the run that wrote it).
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

from core.device import pick_device
from core.errors import ConfigError
from core.files import atomic_write_bytes
from evaluation.attention import long_context_stats, prompt_weights, runs_at, visible_keys
from evaluation.checkpoint import LoadedCheckpoint, load_checkpoint
from evaluation.config import EvalData, check_output_dir
from evaluation.prompts import prompt_text
from evaluation.run import Subject, default_labels, load_texts, results_header

FORMAT = "posgpt-attention/1"
RESULTS = "results.json"
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
    subjects = [Subject(p, label) for p, label in zip(cfg.ckpt, cfg.labels or default_labels(cfg.ckpt), strict=True)]
    for subject, ckpt in zip(subjects, loaded, strict=True):
        _check_indices(subject, ckpt, cfg)
        ckpt.model.to(device).eval()
    prompts = [_prompt_ids(s, c, cfg.prompt) for s, c in zip(subjects, loaded, strict=True)] if cfg.prompt else []
    texts = []
    if cfg.lengths:
        _check_lengths(subjects, loaded, cfg.lengths)
        texts = load_texts(loaded, subjects, cfg.data, cfg.lengths[-1])
    out = Path(cfg.out)
    files: dict[Path, bytes] = {}
    doc: dict[str, Any] = {"format": FORMAT, **results_header(device, torch.float32), "config": dataclasses.asdict(cfg)}
    doc["note"] = "weights recomputed on the eager reference kernel, in float32 (fused kernels never form them)"
    if cfg.prompt:  # a folder per checkpoint: its label made a file name, seeds told apart (name#2)
        safe = ["".join(c if c.isalnum() or c in "-_.+" else "_" for c in s.label) or "model" for s in subjects]
        folders = default_labels([str(Path(name) / "last.ckpt") for name in safe])
        doc["prompts"] = [
            _draw_prompt(s, c, ids, cfg, out / folder, files)
            for s, c, ids, folder in zip(subjects, loaded, prompts, folders, strict=True)
        ]
    if cfg.lengths:
        models = [(s.label, s.path, c.model) for s, c in zip(subjects, loaded, strict=True)]
        doc["lengths"] = long_context_stats(models, [t.tokens for t in texts], cfg.lengths, cfg.tokens,
                                            cfg.sink_tokens, cfg.progress)  # fmt: skip
        from evaluation.attention_figures import stats_figures
        from evaluation.report import png_bytes

        files.update({out / name: png_bytes(fig) for name, fig in stats_figures(doc["lengths"])})
    doc["files"] = sorted(path.relative_to(out).as_posix() for path in files)
    files[out / RESULTS] = json.dumps(doc, indent=1, allow_nan=False).encode()
    for path, payload in files.items():  # results.json last: present, it lists figures that are
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, payload)
    return list(files)


def _check_lengths(subjects: list[Subject], loaded: list[LoadedCheckpoint], lengths: list[int]) -> None:
    """A length no checkpoint reaches is an error; one that only some reach leaves the others out, with a line."""
    for length in lengths:
        able = [runs_at(c.model, length) for c in loaded]
        if not any(able):
            _check_length(subjects[0], loaded[0], length, "--lengths")
        for subject, ckpt, ok in zip(subjects, loaded, able, strict=True):
            if not ok:
                log.info("%s: left out at length %d (positions up to %d)", subject.label, length,
                         ckpt.model.pe.max_positions)  # fmt: skip


def _check_length(subject: Subject, ckpt: LoadedCheckpoint, length: int, what: str) -> None:
    if not runs_at(ckpt.model, length):
        limit = ckpt.model.pe.max_positions
        raise ConfigError(
            f"{subject.path} has {ckpt.model.config.pos_encoding} positions, which exist up to {limit} tokens; "
            f"{what} asks for {length}. Use lengths up to {limit} for it, or leave it out."
        )


def _check_indices(subject: Subject, ckpt: LoadedCheckpoint, cfg: MapsConfig) -> None:
    for what, asked, count in (("layer", cfg.layers, ckpt.model.config.n_layer),
                               ("head", cfg.heads, ckpt.model.config.n_head)):  # fmt: skip
        unknown = [i for i in asked or [] if i >= count]
        if unknown:
            raise ConfigError(
                f"{subject.path} has {count} {what}s (0..{count - 1}); there is no {what} {unknown[0]}. "
                f"Pass --{what}s within 0..{count - 1}."
            )


def _prompt_ids(subject: Subject, ckpt: LoadedCheckpoint, prompt: str) -> list[int]:
    ids = ckpt.tokenizer.encode(prompt_text(prompt))
    if not ids:
        raise ConfigError("The prompt is empty: pass --prompt TEXT with at least one token.")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ConfigError(
            f"The prompt is {len(ids)} tokens for {subject.path}; a heatmap is readable up to {MAX_PROMPT_TOKENS}. "
            "Shorten it, or pass --lengths to see attention at long contexts."
        )
    _check_length(subject, ckpt, len(ids), "the prompt")
    return ids


def _draw_prompt(
    subject: Subject, ckpt: LoadedCheckpoint, ids: list[int], cfg: MapsConfig, folder: Path, files: dict[Path, bytes]
) -> dict[str, Any]:
    """The heatmaps of one checkpoint on the prompt, into `folder`; the plotted numbers (matplotlib imported to
    draw, not for --help)."""
    from evaluation.attention_figures import heatmaps_figure, printable
    from evaluation.report import png_bytes

    model = ckpt.model
    idx = torch.tensor([ids], device=model.wte.weight.device)
    weights = prompt_weights(model, idx)  # per layer (H, T, T)
    visible = visible_keys(model, len(ids))
    tokens = [printable(ckpt.tokenizer.decode([i])) for i in ids]
    layers = cfg.layers if cfg.layers is not None else list(range(model.config.n_layer))
    heads = cfg.heads if cfg.heads is not None else list(range(model.config.n_head))
    name = f"{subject.label} ({model.config.pos_encoding})"
    cols = math.ceil(math.sqrt(len(heads)))
    for layer in layers:
        panels = [(f"head {head}", weights[layer][head]) for head in heads]
        figure = heatmaps_figure(panels, visible, tokens, f"{name}: layer {layer}, weights per head", cols)
        files[folder / f"layer{layer}.png"] = png_bytes(figure)
    means = [(f"layer {layer}, mean over heads", weights[layer][heads].mean(0)) for layer in layers]
    figure = heatmaps_figure(means, visible, tokens, f"{name}: mean over heads", min(len(means), 4))
    files[folder / "layers_mean.png"] = png_bytes(figure)
    return {
        "label": subject.label,
        "ckpt": subject.path,
        "tokens": tokens,
        "ids": ids,
        "weights": {str(layer): _rounded(weights[layer][heads].masked_fill(~visible, 0.0)) for layer in layers},
        "heads": heads,
    }


def _rounded(weights: torch.Tensor) -> list:
    return [[[float(f"{w:.5g}") for w in row] for row in head] for head in weights.tolist()]
