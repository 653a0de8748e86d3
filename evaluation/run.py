"""Evaluate checkpoints at several context lengths (once per RoPE scaling for a RoPE model): the logic
behind `evaluate.py`. Every input is checked before the first forward pass, so a bad one fails in
seconds, not after an hour of evaluation.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from core.device import pick_device_dtype
from core.files import sha256_file, shown_path
from core.repo import git_sha
from data.dataset import load_prepared, recorded_data, window_starts
from data.errors import DataError
from data.prepare import token_dtype
from data.tokenizer import CharTokenizer
from evaluation.attention import long_context_stats
from evaluation.checkpoint import LoadedCheckpoint, load_checkpoint
from evaluation.config import EvalData, EvalSettings
from evaluation.extrapolation import evaluate_length

FORMAT = "posgpt-extrapolation/1"
ATTENTION_TOKENS = 8192
"""Most tokens the attention statistics of `--eval.attention_stats` average over at each length."""
SINK_TOKENS = 4


@dataclass
class Subject:
    """A checkpoint to evaluate, and the label its rows get (a shared label marks seeds of one model)."""

    path: str
    label: str


@dataclass
class EvalText:
    """Token ids to evaluate on, and where they came from."""

    tokens: np.ndarray
    info: dict[str, Any]


def default_labels(paths: list[str]) -> list[str]:
    """`runs/NAME/last.ckpt` -> NAME (a file named otherwise: its stem); repeats get #2, #3, ..."""
    labels: list[str] = []
    for path in paths:
        p = Path(path)
        base = p.parent.name if p.stem in ("last", "best") and p.parent.name else p.stem
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}#{n}"
        labels.append(label)
    return labels


def evaluate_checkpoints(subjects: list[Subject], settings: EvalSettings, data: EvalData) -> dict[str, Any]:
    """Every subject at every length; returns the results document that `evaluation.report` writes."""
    loaded = [load_checkpoint(s.path, data.tiktoken_ranks) for s in subjects]  # all checked before any work
    texts = load_texts(loaded, subjects, data, settings.lengths[-1])
    device, dtype = pick_device_dtype(settings.device, settings.dtype)
    autocast = None if dtype == torch.float32 else dtype
    plan = [
        (subject, ckpt, text, scaling)
        for subject, ckpt, text in zip(subjects, loaded, texts, strict=True)
        for scaling in (settings.rope_scaling if ckpt.model.pe.rescalable else ["none"])
    ]
    total = sum(
        int(window_starts(len(text.tokens), n, settings.stride or n, settings.token_budget).size)
        for _, ckpt, text, _ in plan
        for n in settings.lengths
        if ckpt.model.pe.max_positions is None or n <= ckpt.model.pe.max_positions
    )
    runs = []
    bar_on = settings.progress and sys.stderr.isatty()  # a bar in a log file is a carriage-return flood
    with tqdm(total=total, unit="window", disable=not bar_on, dynamic_ncols=True) as bar:
        for subject, ckpt, text, scaling in plan:
            runs.append(_evaluate_one(subject, ckpt, text, scaling, settings, device, autocast, bar))
    doc = {
        "format": FORMAT,
        **results_header(device, autocast or torch.float32),
        "settings": dataclasses.asdict(settings),
        "data": dataclasses.asdict(data),
        "runs": runs,
    }
    if settings.attention_stats:
        # each model as trained (`_evaluate_one` scales views of it, never the model)
        models = [(s.label, s.path, c.model.to(device).eval()) for s, c in zip(subjects, loaded, strict=True)]
        doc["attention"] = long_context_stats(models, [t.tokens for t in texts], settings.lengths,
                                              min(settings.token_budget, ATTENTION_TOKENS), SINK_TOKENS,
                                              settings.progress)  # fmt: skip
    return doc


def merge_documents(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One results document from documents of the same settings that each evaluated some checkpoints (a
    study evaluates them one at a time), the attention statistics ordered by length, then checkpoint."""
    doc = {**docs[0], "created": max(d["created"] for d in docs), "runs": [r for d in docs for r in d["runs"]]}
    if any("attention" in d for d in docs):
        entries = [(e["length"], i, e) for i, d in enumerate(docs) for e in d.get("attention", [])]
        doc["attention"] = [e for _, _, e in sorted(entries, key=lambda item: item[:2])]
    return doc


def results_header(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """The head of a results file: when, from which code, with which torch, on what, in which dtype."""
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_sha(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }


def _evaluate_one(
    subject: Subject,
    ckpt: LoadedCheckpoint,
    text: EvalText,
    scaling: str,
    settings: EvalSettings,
    device: torch.device,
    autocast: torch.dtype | None,
    bar: tqdm,
) -> dict[str, Any]:
    """One checkpoint under one RoPE scaling ('none': as trained) at every length."""
    trained = ckpt.model.to(device)
    config, rescalable = trained.config, trained.pe.rescalable
    label = subject.label if scaling == "none" else f"{subject.label} + {scaling}"
    rows = []
    for length in settings.lengths:
        model = trained  # as trained, or a view of it with the scaling for this length
        if scaling != "none":  # a fixed factor, or (dynamic) how far past the training length it is
            factor = settings.rope_scaling_factor
            factor = max(1.0, length / config.block_size) if factor == "dynamic" else float(factor)
            model = trained.rescaled(scaling, factor)
        bar.set_description(f"{label} L={length}")
        result = evaluate_length(
            model,
            text.tokens,
            length,
            settings.stride,
            settings.token_budget,
            buckets=settings.buckets,
            batch_tokens=settings.batch_tokens,
            autocast_dtype=autocast,
            on_windows=bar.update,
        )
        row = dataclasses.asdict(result)
        row.update(
            loss=_finite(result.loss),
            ppl=_finite(result.ppl),
            rope_scaling=model.config.rope_scaling if rescalable else None,
            rope_scaling_factor=model.config.rope_scaling_factor if rescalable else None,
        )
        rows.append(row)
    trained.to("cpu")
    return {
        "label": label,
        "model": subject.label,
        "checkpoint": str(subject.path),
        "step": ckpt.step,
        "seed": ckpt.config.get("train", {}).get("seed"),
        "pos_encoding": config.pos_encoding,
        "train_length": config.block_size,
        "tokenizer": _tokenizer_name(ckpt),
        "rope_scaling": scaling if rescalable else None,
        "rope_scaling_factor": settings.rope_scaling_factor if scaling != "none" else None,
        "data": text.info,
        "config": ckpt.config,
        "results": rows,
    }


def _finite(value: float) -> float | None:
    """JSON has no NaN: a number that is not finite (not applicable) is written as null."""
    return value if math.isfinite(value) else None


def _tokenizer_name(ckpt: LoadedCheckpoint) -> str:
    return f"{ckpt.tokenizer.meta()['kind']} ({ckpt.tokenizer.vocab_size})"


def load_texts(loaded: list[LoadedCheckpoint], subjects: list[Subject], data: EvalData, longest: int) -> list[EvalText]:
    """The evaluation text of each checkpoint, tokenized once per distinct tokenizer (and data); each long
    enough for one window of `longest` tokens."""
    memo: dict[str, EvalText] = {}
    texts = []
    for ckpt, subject in zip(loaded, subjects, strict=True):
        own_data = ckpt.config["data"] if not (data.input or data.dir) else None
        key = json.dumps([ckpt.tokenizer.meta(), own_data], sort_keys=True)
        if key not in memo:
            memo[key] = _text_for(ckpt, subject.path, data)
        texts.append(memo[key])
    for subject, text in zip(subjects, texts, strict=True):
        if len(text.tokens) < longest + 1:
            raise DataError(
                f"The evaluation text of {subject.path} has {len(text.tokens)} tokens, too few for one window "
                f"at length {longest} (it needs {longest + 1}). Use shorter --lengths or a longer text."
            )
    return texts


def _text_for(ckpt: LoadedCheckpoint, path: str, data: EvalData) -> EvalText:
    """The tokens `ckpt` is evaluated on: a text file in its own tokenizer, a prepared split in its
    tokenizer, or (default) the split of the data it was trained on."""
    if data.input:
        return _tokenize_file(ckpt, path, Path(data.input), data.drop_unknown)
    if data.dir:
        prepared = load_prepared(data.dir)
        if prepared.meta["tokenizer"] != ckpt.tokenizer.meta():
            raise DataError(
                f"{data.dir} was tokenized with {prepared.meta['tokenizer']['kind']} "
                f"({prepared.meta['tokenizer']['vocab_size']} ids) but {path} uses {_tokenizer_name(ckpt)}. "
                "Pass the text itself with --eval_data.input FILE: each checkpoint then tokenizes it with "
                "its own tokenizer."
            )
        source = f"{shown_path(data.dir)} ({data.split} split)"
    else:
        prepared = recorded_data(path, ckpt.data, ckpt.config["data"], ckpt.tokenizer.meta(), data.tiktoken_ranks)
        source = f"{shown_path(prepared.path)} ({data.split} split, the checkpoint's own data)"
    tokens = np.asarray(prepared.tokens(data.split))
    return EvalText(tokens, {"source": source, "tokens": int(tokens.size), "sha256": _tokens_sha256(tokens)})


def _tokenize_file(ckpt: LoadedCheckpoint, ckpt_path: str, path: Path, drop_unknown: bool) -> EvalText:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"--eval_data.input {path}: no such file.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"Cannot read --eval_data.input {path} as UTF-8 text: {error}") from None
    tok = ckpt.tokenizer
    if isinstance(tok, CharTokenizer):
        unknown = sorted(set(text) - set(tok.chars))
        if unknown and not drop_unknown:
            raise DataError(
                f"{path} has {len(unknown)} distinct characters outside the vocabulary of {ckpt_path} "
                f"(a char-level model knows only its corpus' characters): {''.join(unknown[:40])!r}. "
                "Pass --eval_data.drop_unknown true to leave them out."
            )
        ids = tok.encode(text, drop_unknown=True)
    else:
        ids = tok.encode(text)
    tokens = np.asarray(ids, dtype=token_dtype(tok.vocab_size))
    info = {
        "source": str(path),
        "text_sha256": sha256_file(path),
        "tokens": int(tokens.size),
        "sha256": _tokens_sha256(tokens),
    }
    return EvalText(tokens, info)


def _tokens_sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()
