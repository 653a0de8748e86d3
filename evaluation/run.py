"""`evaluate.py`: checkpoints at several context lengths (once per RoPE scaling for a RoPE model), with its
options (also a study's eval: section). Every input is checked before the first forward pass, so a bad one
fails in seconds, not after an hour of evaluation.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from posgpt.core.cli import Command
from posgpt.core.device import pick_device_dtype
from posgpt.core.errors import UserError, did_you_mean
from posgpt.data.dataset import window_starts
from posgpt.data.probes import PROBES
from posgpt.evaluation.attention_stats import long_context_stats, runs_at
from posgpt.evaluation.checkpoint import (
    EvalData,
    check_output_dir,
    default_labels,
    load_checkpoint,
    load_texts,
    progress_bar,
    results_header,
    tokenizer_name,
)
from posgpt.evaluation.extrapolation import evaluate_length
from posgpt.evaluation.probes import probe_rows
from posgpt.model.config import AS_TRAINED, RopeScaling
from posgpt.model.gpt import GPT

log = logging.getLogger(__name__)

FORMAT = "posgpt-extrapolation/1"
ATTENTION_TOKENS = 8192
"""Most tokens the attention statistics of `--eval.attention_stats` average over at each length."""
SINK_TOKENS = 4


@dataclass
class EvalSettings:
    """How each checkpoint is evaluated: lengths, mode, budget, RoPE scaling, hardware."""

    lengths: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048, 4096])
    """Context lengths L to evaluate at, in tokens."""
    mode: Literal["nonoverlap", "sliding"] = "nonoverlap"
    """nonoverlap: windows of L, every token scored; sliding: windows advance by `stride`, their last S scored."""
    stride: int | None = None
    """Stride S of the sliding mode, at most the smallest length."""
    token_budget: int = 65536
    """Tokens scored at every length, from the start of the text, so lengths compare on equal footing."""
    rope_scaling: list[RopeScaling] = field(default_factory=lambda: [AS_TRAINED])
    """RoPE checkpoints are evaluated once per entry: none (as trained), linear (position interpolation), ntk, yarn."""
    rope_scaling_factor: float | Literal["dynamic"] = "dynamic"
    """A fixed factor (>= 1) for the scaled RoPE variants, or 'dynamic': max(1, L / L0) at each length L, L0 the
    model's original length (`GPTConfig.original_block_size`, else its block_size)."""
    buckets: int = 16
    """Position buckets for the loss-by-position curves."""
    batch_tokens: int = 32768
    """Tokens per forward pass (fewer on CPU to bound the L x L scores; halved on a CUDA out-of-memory error)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Autocast dtype: auto is bfloat16 on a GPU that has it, float32 otherwise (losses in float32)."""
    progress: bool = True
    """Show a progress bar (on a terminal only: a log file gets none)."""
    attention_stats: bool = False
    """Also the attention statistics of attention_maps.py at every length: entropy, sink mass, sink rate and figures."""
    short_window: int | None = None
    """Also key-token perplexity (LongPPL) at every length, key tokens found against a context of this many tokens
    (0: a quarter of each checkpoint's block_size; docs/probes.md); non-overlapping windows only."""
    probes: list[str] = field(default_factory=list)
    """Retrieval probes, scored zero-shot (docs/probes.md): passkey, niah_single_1, niah_multikey_1/2/3,
    niah_multivalue, niah_multiquery, vt."""
    probe_lengths: list[int] | None = None
    """Their lengths in tokens (default: 1, 2, 4 and 8 times each checkpoint's block_size)."""
    probe_depths: list[float] | Literal["uniform"] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Where the needle sits (0 = start, 1 = end), or 'uniform': drawn as the references draw it."""
    probe_trials: int = 10
    """Prompts per cell (probe, length, depth), answered in one batch."""

    def __post_init__(self) -> None:
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive integers, got {self.lengths!r}.")
        self.lengths = sorted(set(self.lengths))
        if self.mode == "sliding":
            if self.stride is None:
                raise ValueError("mode 'sliding' needs --eval.stride S (the tokens scored per window).")
            if not 0 < self.stride <= self.lengths[0]:
                raise ValueError(f"stride must be in 1..{self.lengths[0]} (the smallest length), got {self.stride}.")
        elif self.stride is not None:
            raise ValueError("--eval.stride applies to --eval.mode sliding only; drop it or add --eval.mode sliding.")
        if self.token_budget < 1 or self.buckets < 1 or self.batch_tokens < 1:
            raise ValueError("token_budget, buckets and batch_tokens must be positive.")
        if self.rope_scaling_factor != "dynamic" and float(self.rope_scaling_factor) < 1:
            raise ValueError(f"rope_scaling_factor must be >= 1 or 'dynamic', got {self.rope_scaling_factor!r}.")
        pick_device_dtype(self.device, self.dtype)  # a device this machine has
        unknown = sorted(set(self.probes) - PROBES.keys())
        if unknown:
            raise ValueError(f"No probe {unknown[0]!r}: choose from {', '.join(PROBES)}"
                             f"{did_you_mean(unknown[0], list(PROBES), '') or '.'}")  # fmt: skip
        if self.probe_depths != "uniform" and not (self.probe_depths and all(0 <= d <= 1 for d in self.probe_depths)):
            raise ValueError(f"probe_depths must be in [0, 1] (or 'uniform'), got {self.probe_depths!r}.")
        if self.probe_trials < 1 or any(n < 1 for n in self.probe_lengths or [1]):
            raise ValueError("probe_trials and probe_lengths must be positive.")
        if self.short_window is not None and (self.short_window < 0 or self.mode != "nonoverlap"):
            raise ValueError("short_window (key-token perplexity) is 0 or more, with --eval.mode nonoverlap.")
        if not self.rope_scaling or len(set(self.rope_scaling)) != len(self.rope_scaling):
            raise ValueError(f"rope_scaling needs distinct entries (none = as trained), got {self.rope_scaling!r}.")

    def lengths_of_probes(self, model: GPT) -> list[int]:
        """The probes' lengths for `model`: those asked, else 1, 2, 4 and 8 times its training length."""
        return self.probe_lengths or [n * model.config.block_size for n in (1, 2, 4, 8)]


@dataclass
class EvaluateConfig:
    """evaluate.py's options: which checkpoints, their labels, where the report goes, how and on what text."""

    ckpt: list[str]
    """Checkpoints written by train.py."""
    labels: list[str] | None = None
    """A name per checkpoint (default: its run directory); a shared name marks seeds of one model: mean ± std."""
    out: str = "eval"
    """Directory for the results (created if needed)."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    """How each checkpoint is evaluated."""
    eval_data: EvalData = field(default_factory=EvalData)
    """The text (default: each checkpoint's own validation split)."""

    def __post_init__(self) -> None:
        if not self.ckpt:
            raise ValueError("Pass at least one checkpoint: --ckpt A.ckpt [B.ckpt ...].")
        if self.labels is not None and len(self.labels) != len(self.ckpt):
            raise ValueError(f"--labels gives {len(self.labels)} names for {len(self.ckpt)} checkpoints.")


def evaluate_checkpoints(paths: list[str], labels: list[str], settings: EvalSettings, data: EvalData) -> dict[str, Any]:
    """Every checkpoint (a shared label marks seeds of one model) at every length: what `evaluation.report` writes."""
    loaded = [load_checkpoint(path, data.tiktoken_ranks) for path in paths]  # all checked before any work
    texts = load_texts(loaded, data, settings.lengths[-1])
    device, dtype = pick_device_dtype(settings.device, settings.dtype)
    autocast = None if dtype == torch.float32 else dtype
    scaled = "/".join(s for s in settings.rope_scaling if s != AS_TRAINED)
    plan = []  # (label, checkpoint, text, RoPE scaling) for every run
    for label, ckpt, text in zip(labels, loaded, texts, strict=True):  # a RoPE model no scaling here stretches: said
        if len(ckpt.model.rope_bases) > 1 and scaled:
            turns = ", ".join(f"{b:,.0f}" for b in ckpt.model.rope_bases)
            log.warning(f"{label}: its kinds turn RoPE at bases {turns}, which {scaled} does not stretch alike "
                        "(Gemma 3 scales its global layers only): evaluated as trained")  # fmt: skip
        c = ckpt.model.config  # trained scaled: as trained, or its own scaling stretched further
        fit = [s for s in settings.rope_scaling if not c.scales_rope or s in (AS_TRAINED, c.rope_scaling)]
        if ckpt.model.rescalable and len(fit) < len(settings.rope_scaling):
            log.info(f"{label}: trained with rope_scaling {c.rope_scaling}: evaluated with it alone")
        plan += [(label, ckpt, text, s) for s in (fit if ckpt.model.rescalable else [AS_TRAINED])]
    total = sum(
        int(window_starts(len(text[0]), n, settings.stride or n, settings.token_budget).size)
        for _, ckpt, text, _ in plan
        for n in settings.lengths
        if runs_at(ckpt.model, n)
    )

    depths = [None] if settings.probe_depths == "uniform" else list(settings.probe_depths)
    total += sum(len(settings.probes) * len(depths) * len(settings.lengths_of_probes(c.model)) for _, c, _, _ in plan)
    runs = []
    with progress_bar(total, "window", settings.progress) as bar:
        for name, ckpt, text, scaling in plan:  # rows labelled `name`, under one RoPE scaling ('none': as trained)
            trained = ckpt.model.to(device)
            config, rescalable = trained.config, trained.rescalable
            label = name if scaling == AS_TRAINED else f"{name} + {scaling}"
            rows = []
            short = settings.short_window
            short = config.block_size // 4 if short == 0 else short  # 0: a quarter of the training length
            for length in settings.lengths:
                model = at_length(trained, scaling, settings.rope_scaling_factor, length)
                bar.set_description(f"{label} L={length}")
                result = evaluate_length(model, text[0], length, settings.stride, settings.token_budget,
                                         buckets=settings.buckets, batch_tokens=settings.batch_tokens,
                                         autocast_dtype=autocast, on_windows=bar.update,
                                         short_window=short)  # fmt: skip
                row = dataclasses.asdict(result)
                row["rope_scaling"] = model.config.rope_scaling if rescalable else None
                row["rope_scaling_factor"] = model.config.rope_scaling_factor if rescalable else None
                rows.append(row)
            probes: list[dict[str, Any]] = []
            probe_lengths = settings.lengths_of_probes(trained)
            haystack = ckpt.tokenizer.decode(text[0][: 2 * max(probe_lengths)]) if settings.probes else ""
            for length in probe_lengths if settings.probes else []:
                bar.set_description(f"{label} probes L={length}")
                with torch.autocast(device.type, dtype, enabled=autocast is not None):
                    model = at_length(trained, scaling, settings.rope_scaling_factor, length)
                    probes += probe_rows(model, ckpt.tokenizer, settings.probes, [length], depths,
                                         settings.probe_trials, haystack, on_cell=bar.update)  # fmt: skip
            trained.to("cpu")
            runs.append(
                {
                    "label": label,
                    "model": name,
                    "checkpoint": ckpt.path,
                    "step": ckpt.step,
                    "seed": ckpt.config.get("train", {}).get("seed"),
                    "pos_encoding": config.pos_encoding,
                    "train_length": config.block_size,
                    "params": trained.num_params(),
                    "tokenizer": tokenizer_name(ckpt),
                    "rope_scaling": scaling if rescalable else None,
                    "rope_scaling_factor": settings.rope_scaling_factor if scaling != AS_TRAINED else None,
                    "data": text[1],
                    "config": ckpt.config,
                    "results": rows,
                    "probes": probes,
                }
            )
    doc = {
        "format": FORMAT,
        **results_header(device, dtype),
        "settings": dataclasses.asdict(settings),
        "data": dataclasses.asdict(data),
        "runs": runs,
    }
    if settings.attention_stats:  # each model as trained (`evaluate_one` scales views of it, never the model)
        doc["attention"] = long_context_stats(labels, loaded, texts, settings.lengths,
                                              min(settings.token_budget, ATTENTION_TOKENS), SINK_TOKENS, device,
                                              settings.progress)  # fmt: skip
    return doc


def at_length(trained: GPT, scaling: str, factor: float | str, length: int) -> GPT:
    """The model at `length` under a RoPE scaling: a view of it at a fixed factor, or (dynamic) at how far `length`
    is past its original length (`GPTConfig.original_length`); as trained for 'none'."""
    if scaling == AS_TRAINED:
        return trained
    c = trained.config  # a model trained scaled is never scaled less than it trained
    least = c.rope_scaling_factor if c.scales_rope else 1.0
    return trained.rescaled(scaling, max(least, length / c.original_length) if factor == "dynamic" else float(factor))


def merge_documents(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One results document from documents of the same settings that each evaluated some checkpoints (a
    study evaluates them one at a time), the attention statistics ordered by length, then checkpoint."""
    doc = {**docs[0], "created": max(d["created"] for d in docs), "runs": [r for d in docs for r in d["runs"]]}
    if any("attention" in d for d in docs):  # a stable sort: the documents' order within a length
        doc["attention"] = sorted((e for d in docs for e in d.get("attention", [])), key=lambda e: e["length"])
    return doc


def evaluate_main(cfg: EvaluateConfig) -> None:
    from posgpt.evaluation.report import write_report  # matplotlib: imported to draw, not for --help

    check_output_dir(cfg.out)
    doc = evaluate_checkpoints(cfg.ckpt, cfg.labels or default_labels(cfg.ckpt), cfg.eval, cfg.eval_data)
    try:
        paths = write_report(doc, cfg.out)
    except OSError as error:
        raise UserError(f"cannot write the results to {cfg.out}: {error.strerror or error}.") from error
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))


COMMAND = Command(
    "evaluate.py",
    EvaluateConfig,
    evaluate_main,
    """Perplexity against context length: --ckpt A.ckpt [B.ckpt ...] --eval.lengths 128 4096.

Scores every checkpoint at every length on the same text, with the same number of scored tokens per length,
and writes results.json, results.md, ppl_vs_length.png and loss_by_position.png to --out. The text is each
checkpoint's own validation split unless --eval_data.input FILE (tokenized with each checkpoint's own
tokenizer) or --eval_data.dir PREPARED is given. The options are the eval: and eval_data: sections of a
study's config, under the same names.""",
)
