"""What the commands that read checkpoints share (sampling, evaluation, attention maps, the studies): a
checkpoint alone rebuilds its model and tokenizer, without a Trainer; its label; the text it is evaluated on;
the head of a results file. Imports neither Lightning nor `training/`, so scripts that only read checkpoints
stay light.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm import tqdm

from posgpt.core.checkpoint import CheckpointError, read_checkpoint
from posgpt.core.errors import ConfigError
from posgpt.core.files import sha256_file, shown_path
from posgpt.core.repo import git_sha
from posgpt.data.dataset import checkpoint_tokenizer, load_prepared, recorded_data
from posgpt.data.errors import DataError
from posgpt.data.prepare import token_dtype
from posgpt.data.tokenizer import CharTokenizer, Tokenizer
from posgpt.model import GPT, GPTConfig

PREFIX = "model."
"""Where the `GPTModule` keeps the GPT's weights in its state dict."""


@dataclass
class LoadedCheckpoint:
    """What a checkpoint rebuilds: its model and tokenizer, and what it recorded of its run."""

    model: GPT
    tokenizer: Tokenizer
    config: dict[str, Any]
    """The resolved run config."""
    step: int
    data: dict[str, Any] | None
    """The training data's provenance (None in checkpoints written before it was recorded)."""
    path: str


def model_config_of(ckpt: dict[str, Any]) -> GPTConfig:
    """The model config a checkpoint recorded (after `train.switch_at`, the one it switched to)."""
    return GPTConfig.from_dict(ckpt.get("model_config") or ckpt["hyper_parameters"]["config"]["model"])


def gpt_from_checkpoint(ckpt: dict[str, Any], path: str | Path) -> GPT:
    """The GPT that `ckpt` (read from `path`) holds (after `train.switch_at`, the one it switched to), on CPU
    in eval mode; weights that do not fit its config or are not finite are refused."""
    model = GPT(model_config_of(ckpt))
    state = {k[len(PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(PREFIX)}
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        misfit = weights_misfit(model.state_dict(), state) or str(error).strip().splitlines()[0]
        raise CheckpointError(
            f"{path}: its weights do not fit its own recorded config ({misfit}): the file was edited or written "
            "by other code. Use a checkpoint this trainer wrote, or retrain."
        ) from None
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise CheckpointError(
            f"{path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}): the run that wrote it diverged. "
            "Use an earlier checkpoint, or retrain with a lower --optim.lr."
        )
    return model.eval()


def weights_misfit(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str:
    """Why `state` does not load into a model whose state dict is `expected`, in one clause ('' if it does);
    PyTorch's own message lists every mismatch where a user needs the first."""
    if wrong := [name for name, tensor in expected.items() if name in state and state[name].shape != tensor.shape]:
        more = f"; {len(wrong) - 1} more tensor(s) differ" if len(wrong) > 1 else ""
        name = wrong[0]
        return f"{name} is {tuple(state[name].shape)} in the file, {tuple(expected[name].shape)} for the config{more}"
    found = {"missing": [n for n in expected if n not in state], "unexpected": [n for n in state if n not in expected]}
    return "; ".join(
        f"{what} {', '.join(names[:2])}{' and more' if names[2:] else ''}" for what, names in found.items() if names
    )


def load_checkpoint(path: str | Path, ranks_path: str | None = None) -> LoadedCheckpoint:
    """The model (on CPU, eval mode) and tokenizer a checkpoint holds; `ranks_path` overrides its GPT-2 ranks file."""
    ckpt = read_checkpoint(path)
    hparams = ckpt["hyper_parameters"]
    model = gpt_from_checkpoint(ckpt, path)
    recorded = hparams["config"]["data"].get("tiktoken_ranks")
    tokenizer = checkpoint_tokenizer(hparams["tokenizer"], recorded, ranks_path, path)
    step = int(ckpt.get("global_step", 0))
    return LoadedCheckpoint(model, tokenizer, hparams["config"], step, hparams.get("data"), str(path))


@dataclass
class EvalData:
    """The text to evaluate on (default: each checkpoint's own validation split)."""

    input: str | None = None
    """A text file, tokenized with each checkpoint's own tokenizer."""
    dir: str | None = None
    """A directory written by `posgpt prepare` (its tokenizer must be the checkpoints')."""
    split: Literal["val", "train"] = "val"
    """Split of a prepared directory (or of each checkpoint's own data)."""
    tiktoken_ranks: str | None = None
    """Local r50k_base.tiktoken for offline GPT-2 BPE (or set POSGPT_TIKTOKEN_RANKS)."""
    drop_unknown: bool = False
    """With --eval_data.input and a char-level checkpoint: leave out characters outside its vocabulary."""

    def __post_init__(self) -> None:
        if self.input and self.dir:
            raise ValueError("Pass either --eval_data.input FILE or --eval_data.dir PREPARED, not both.")


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


def results_header(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """The head of a results file: when, from which code, with which torch, on what, in which dtype."""
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_sha(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }


def progress_bar(total: int, unit: str, show: bool = True) -> tqdm:
    """A bar on stderr, shown on a terminal only: a bar in a log file is a carriage-return flood."""
    return tqdm(total=total, unit=unit, disable=not (show and sys.stderr.isatty()), dynamic_ncols=True)


def check_output_dir(out: str) -> None:
    """Stop before any evaluation when the results cannot be written to `out`."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a directory (created if needed) for the results.")
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))  # the nearest that exists
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {existing} cannot be written; pass a directory you can write.")


def tokenizer_name(ckpt: LoadedCheckpoint) -> str:
    """As results name it: `char (65)`, `gpt2 (50257)`."""
    return f"{ckpt.tokenizer.meta()['kind']} ({ckpt.tokenizer.vocab_size})"


def load_texts(loaded: list[LoadedCheckpoint], data: EvalData, longest: int) -> list[tuple[np.ndarray, dict]]:
    """The evaluation text of each checkpoint, (tokens, where they came from), tokenized once per distinct
    tokenizer (and data); each long enough for one window of `longest` tokens."""
    memo: dict[str, tuple[np.ndarray, dict]] = {}
    texts = []
    for ckpt in loaded:
        own_data = ckpt.config["data"] if not (data.input or data.dir) else None
        key = json.dumps([ckpt.tokenizer.meta(), own_data], sort_keys=True)
        if key not in memo:
            memo[key] = _text_for(ckpt, data)
        texts.append(memo[key])
        if len(texts[-1][0]) < longest + 1:
            raise DataError(
                f"The evaluation text of {ckpt.path} has {len(texts[-1][0])} tokens, too few for one window "
                f"at length {longest} (it needs {longest + 1}). Use shorter --lengths or a longer text."
            )
    return texts


def _text_for(ckpt: LoadedCheckpoint, data: EvalData) -> tuple[np.ndarray, dict[str, Any]]:
    """The tokens `ckpt` is evaluated on: a text file in its own tokenizer, a prepared split in its
    tokenizer, or (default) the split of the data it was trained on."""
    if data.input:
        path = Path(data.input)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"--eval_data.input {path}: no such file.") from None
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"Cannot read --eval_data.input {path} as UTF-8 text: {error}") from None
        tok = ckpt.tokenizer
        if isinstance(tok, CharTokenizer) and not data.drop_unknown and (unknown := sorted(set(text) - set(tok.chars))):
            raise DataError(
                f"{path} has {len(unknown)} distinct characters outside the vocabulary of {ckpt.path} "
                f"(a char-level model knows only its corpus' characters): {''.join(unknown[:40])!r}. "
                "Pass --eval_data.drop_unknown true to leave them out."
            )
        tokens = np.asarray(tok.encode(text, drop_unknown=True), dtype=token_dtype(tok.vocab_size))
        info = {"source": str(path), "text_sha256": sha256_file(path)}
    else:
        if data.dir:
            prepared = load_prepared(data.dir)
            if prepared.meta["tokenizer"] != ckpt.tokenizer.meta():
                raise DataError(
                    f"{data.dir} was tokenized with {prepared.meta['tokenizer']['kind']} "
                    f"({prepared.meta['tokenizer']['vocab_size']} ids) but {ckpt.path} uses {tokenizer_name(ckpt)}. "
                    "Pass the text itself with --eval_data.input FILE: each checkpoint then tokenizes it with "
                    "its own tokenizer."
                )
            source = f"{shown_path(data.dir)} ({data.split} split)"
        else:
            meta = ckpt.tokenizer.meta()
            prepared = recorded_data(ckpt.path, ckpt.data, ckpt.config["data"], meta, data.tiktoken_ranks)
            source = f"{shown_path(prepared.path)} ({data.split} split, the checkpoint's own data)"
        tokens = np.asarray(prepared.tokens(data.split))
        info = {"source": source}
    sha256 = hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()
    return tokens, {**info, "tokens": int(tokens.size), "sha256": sha256}
