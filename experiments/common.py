"""What the one-command experiments share: named model variants, one run per model and seed under
<out_dir>/runs, reuse of finished runs and resumption of interrupted ones, the plan and its time limit, and the
report's last words.

The plan's estimate is the training FLOPs left (`GPT.flops_per_token`) over what the device sustains (a GPU's
peak or a CPU's measured matmul rate, times a typical utilisation), recalibrated by the runs that finish.
A `Launch` of the command ends within its `--max_minutes`: each run gets what is left of it, and the study stops
in time."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from posgpt.core.checkpoint import CheckpointError, read_checkpoint
from posgpt.core.cli import Command
from posgpt.core.errors import TIME_LIMIT_EXIT, ConfigError, TrainingStopped, did_you_mean
from posgpt.core.files import atomic_write_bytes
from posgpt.core.repo import git_sha
from posgpt.core.units import format_seconds, progress_line
from posgpt.model import GPT, POS_ENCODINGS, GPTConfig
from posgpt.training.config import RunConfig
from posgpt.training.hardware import peak_flops, resolve_precision, uses_cuda

if TYPE_CHECKING:
    from posgpt.training.run import TrainingData

log = logging.getLogger(__name__)

HIDDEN = frozenset({"run.model.vocab_size"})  # set from the data; older experiment.yaml files record it

VARIANT_FORMAT = (
    "A variant is a name and what it changes in the shared run: {name: rope-w64, model: {pos_encoding: rope, "
    "attn_window: 64}, train: {random_positions: 512}}; experiment files written before model fields went under "
    "model: and random_positions under train: need that change."
)

PER_RUN = ("seed", "out_dir", "run_name", "resume")  # train fields the experiment sets for every run
UTILISATION = 0.35
"""Share of the peak a training step sustains (an H100 trains GPT-2 124M at ~38% MFU, BENCHMARKS.md)."""
CHAR_VOCAB = 256
"""The vocabulary assumed for a character-level model in the estimate (it is the corpus' own)."""
LONG_ON_CPU = 3600.0
"""Seconds of estimated training past which a plan on a CPU names a shorter config."""
STARTUP_RESERVE_S = 60.0
"""Seconds of the time limit (at most a tenth of it) below which no run or evaluation is begun."""


def experiment_command(prog: str, config: type, main: Callable[[Any], object], description: str) -> Command:
    """A study's command line: its options, what runs them, and what older files need to load."""
    return Command(prog, config, main, description, hidden=HIDDEN, hints={'Parser key "variants"': VARIANT_FORMAT})


@dataclass
class Variant:
    """A model beside the plain schemes: a name and what it changes in the shared run, e.g.
    `{name: rope-window64, model: {pos_encoding: rope, attn_window: 64}}` or
    `{name: rope-randpos, model: {pos_encoding: rope}, train: {random_positions: 512}}`."""

    name: str
    """Label in the report and name of its runs (<name>-seed<S>)."""
    model: dict[str, Any] = field(default_factory=dict)
    """Fields of the shared run's model (run.model) that this model sets otherwise."""
    train: dict[str, Any] = field(default_factory=dict)
    """Fields of the shared run's training (run.train) that this model sets otherwise (say, random_positions)."""
    optim: dict[str, Any] = field(default_factory=dict)
    """Fields of the shared run's optimizer (run.optim) that this model sets otherwise (say, a fine-tune's lr)."""
    extends: str | None = None
    """A model listed before this one whose final checkpoint of the same seed this one starts from (`init_from`: a
    fine-tune, with a fresh optimizer, schedule and data)."""


@dataclass
class Study:
    """What the study configs share: their models (`schemes`, `variants`), checked before any training, and the
    time the command may take."""

    schemes: list[str] = field(default_factory=lambda: list(POS_ENCODINGS))
    """Position schemes to train, one model each (per seed)."""
    variants: list[Variant] = field(default_factory=list)
    """Further models, each {name: N, model: {...}, train: {...}}: overrides of the shared run, scored alike."""
    only: list[str] | None = None
    """Only the models of these names, schemes and variants (--only rope hybrid); null: every one."""
    seeds: list[int] = field(default_factory=lambda: [1337])
    """Training seeds; with several, the table shows mean ± std across seeds."""
    max_minutes: float = 0.0
    """End this command cleanly within this many minutes (0: no limit): the run in progress saves its last.ckpt,
    evaluations done are kept, and the command exits with status 75; the same command continues the study."""

    def __post_init__(self) -> None:
        """Refuse an empty or repeating experiment and a model whose overrides the config classes refuse, in one
        line that names the model."""
        models, seeds = self.models(), self.seeds
        if not models or not seeds:
            raise ConfigError("An experiment needs at least one scheme or variant, and one seed.")
        names = [m.name for m in models]
        if len(set(names)) != len(names) or len(set(seeds)) != len(seeds):
            raise ConfigError(f"schemes, variant names and seeds must not repeat: {names}, {seeds}.")
        for k, variant in enumerate(models):
            try:
                if variant.extends is not None and variant.extends not in names[:k]:
                    raise ConfigError(f"extends {variant.extends!r}, which is not a model listed before it.")
                for section in ("model", "train", "optim"):
                    overrides = getattr(variant, section)
                    known = [f.name for f in dataclasses.fields(getattr(self.run, section)) if f.init]
                    for name in overrides:
                        if name not in known:
                            raise ConfigError(
                                f"{section} has no field {name!r}{did_you_mean(name, known, section + '.')}"
                            )
                        if section == "train" and name in PER_RUN:
                            raise ConfigError(f"train.{name} is set for every run by the experiment (seeds, out_dir).")
                run_config_for(self.run, ".", variant, seeds[0])
            except (TypeError, ValueError) as error:  # TypeError: a value of the wrong type met a check
                raise ConfigError(f"{variant.name}: {error}") from None

    def every_model(self) -> list[Variant]:
        """Each scheme as it is (a variant that sets only model.pos_encoding), then the variants."""
        return [Variant(s, {"pos_encoding": s}) for s in self.schemes] + list(self.variants)

    def models(self) -> list[Variant]:
        """Every model, or those `only` names and the models they start from (`extends`)."""
        every = self.every_model()
        names = [m.name for m in every]
        for name in sorted(set(self.only or ()) - set(names)):
            hint = did_you_mean(name, names, "") or "."
            raise ConfigError(f"--only {name}: no such model; the models are {', '.join(names)}{hint}")
        chosen = set(self.only or names)
        for model in reversed(every):  # what a chosen model starts from is listed before it
            if model.name in chosen and model.extends:
                chosen.add(model.extends)
        return [m for m in every if m.name in chosen]


def run_config_for(run: RunConfig, out_dir: str, variant: Variant, seed: int) -> RunConfig:
    """The shared run with this model and seed, trained under <out_dir>/runs/<name>-seed<seed>; the
    config classes check the result as they check any config."""
    runs = Path(out_dir) / "runs"
    train = dataclasses.replace(run.train, **variant.train, seed=seed, out_dir=str(runs),
                                run_name=f"{variant.name}-seed{seed}", resume="auto")  # fmt: skip
    start = {"init_from": str(runs / f"{variant.extends}-seed{seed}" / "last.ckpt")} if variant.extends else {}
    model = dataclasses.replace(run.model, **{**variant.model, **start})
    return dataclasses.replace(run, model=model, train=train, optim=dataclasses.replace(run.optim, **variant.optim))


@dataclass
class PlannedRun:
    """One training run of a study, and how far it got."""

    label: str
    """The model's name (a scheme or a variant)."""
    name: str
    """The run's directory name, <label>-seed<S>."""
    config: RunConfig
    ckpt: Path
    step: int
    """Optimizer steps done (0: not started)."""

    @property
    def done(self) -> bool:
        return self.step >= self.config.train.max_steps

    @property
    def seed(self) -> int:
        return self.config.train.seed


def flops_per_step(config: RunConfig, vocab_size: int | None) -> float:
    """Training FLOPs of one optimizer step of `config`'s model, built on the meta device (no memory); without
    `vocab_size`, GPT-2's for BPE and `CHAR_VOCAB` for characters."""
    vocab_size = vocab_size or (GPTConfig.vocab_size if config.data.tokenizer == "gpt2" else CHAR_VOCAB)
    model_config = dataclasses.replace(config.model, vocab_size=vocab_size)
    with torch.device("meta"):
        model = GPT(model_config)
    return float(model.flops_per_token(model_config.block_size)) * run_tokens(config) / config.train.max_steps


def sustained_flops(device: torch.device, precision: str = "bf16-mixed") -> float:
    """FLOP/s a training step sustains on `device`, roughly: a GPU's peak, or a CPU's float32 matmul rate
    measured now, times `UTILISATION`."""
    peak = peak_flops(device, precision)
    if peak is None:  # the timer warms up first; its default is one thread
        from torch.utils import benchmark  # a tenth of a second: not for the command's --help

        timer = benchmark.Timer("a @ a", globals={"a": torch.randn(512, 512)}, num_threads=torch.get_num_threads())
        peak = 2 * 512**3 / timer.timeit(8).mean
    return peak * UTILISATION


class TrainingEstimate:
    """Run k of n, and the ETA of what is left, recalibrated by the runs that finished."""

    def __init__(self, plan: list[PlannedRun], vocab_size: int | None) -> None:
        """Before any run of `plan` (all on one device): the estimate from the FLOPs that device sustains."""
        t = plan[0].config.train
        device = torch.device("cuda" if uses_cuda(t.accelerator) else "cpu")
        self.seconds_per_flop = 1 / sustained_flops(device, resolve_precision(t.precision, t.accelerator))
        self.step_flops = {r.name: flops_per_step(r.config, vocab_size) for r in plan}
        self.device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.measured = [0.0, 0.0]  # seconds and FLOPs of the runs trained here

    def left(self, run: PlannedRun) -> float:
        return self.step_flops[run.name] * max(0, run.config.train.max_steps - run.step)

    def estimate(self, runs: list[PlannedRun]) -> float:
        """Seconds the training of `runs` takes, as estimated now."""
        return sum(self.left(r) for r in runs) * self.seconds_per_flop

    def finished(self, seconds: float, flops: float) -> None:
        self.measured = [self.measured[0] + seconds, self.measured[1] + flops]
        self.seconds_per_flop = self.measured[0] / self.measured[1]


def run_tokens(cfg: RunConfig) -> int:
    """The tokens a run trains on (a task's: an upper bound)."""
    t = cfg.train
    return t.max_steps * t.batch_size * t.grad_accum * cfg.model.block_size


def describe(plan: list[PlannedRun], progress: TrainingEstimate, shorter: tuple[str, int] | None = None) -> str:
    """The plan, a line a run, and the estimate of its training time; on a CPU past an hour, how to shorten it:
    `shorter`, a config and the tokens its runs train on, where this plan trains on more than twice as many, else
    the options that train less."""
    lines = [f"Plan: {len(plan)} training run(s) on {progress.device}"]
    for k, run in enumerate(plan, 1):
        t = run.config.train
        state = "trained, reused" if run.done else f"resumes at step {run.step}" if run.step else "to train"
        tokens = run_tokens(run.config) / 1e6
        lines.append(f"  {k:>3}. {run.name}: {t.max_steps} steps x {t.batch_size * t.grad_accum} x "
                     f"{run.config.model.block_size} = {tokens:.1f}M tokens ({state})")  # fmt: skip
    todo = [r for r in plan if not r.done]
    seconds = progress.estimate(todo)
    lines.append(f"Estimated training time: {format_seconds(seconds)} for {len(todo)} run(s) "
                 f"(rough: FLOPs at {UTILISATION:.0%} of the device's peak; small models on a CPU often run faster), "
                 "then the evaluation")  # fmt: skip
    if progress.device == "cpu" and seconds > LONG_ON_CPU:
        if shorter and sum(run_tokens(r.config) for r in todo) > 2 * shorter[1]:
            lines.append(f"That is long for a CPU: --config {shorter[0]} is a first study in about 5 minutes; "
                         "--max_minutes N trains this one in pieces that resume.")  # fmt: skip
        else:
            lines.append(
                "That is long for a CPU: fewer models or seeds (--only, --seeds) or steps "
                "(--run.train.max_steps) train less; --max_minutes N trains it in pieces that resume."
            )
    return "\n".join(lines)


def stopped_study(stop: TrainingStopped, what: str) -> TrainingStopped:
    """A run's (or the evaluation's) stop, told as the study's: the same command continues it."""
    return TrainingStopped(
        f"{str(stop).split(';')[0]} ({what}). Run the same command again to continue: finished runs and evaluations "
        "are reused, an interrupted run resumes from its last.ckpt.",
        stop.exit_code,
    )


def run_record(run: PlannedRun) -> dict[str, Any]:
    """What a study reports of one trained run: its steps, training tokens and wall time (summed over
    the launches that trained it) and its data, read from its checkpoint."""
    ckpt = read_checkpoint(run.ckpt, mmap=True)
    data = ckpt.get("hyper_parameters", {}).get("data") or {}
    corpus = data.get("prepared") if "task" not in data else f"task {data['task']['name']}"
    return {
        "label": run.label,
        "seed": run.seed,
        "steps": int(ckpt.get("global_step", 0)),
        "tokens": int(ckpt.get("tokens_seen", 0)),
        "train_seconds": ckpt.get("train_seconds"),
        "data": {"corpus": corpus, "sources": data.get("sources"), "train_tokens": data.get("train_tokens")},
    }


class Launch:
    """One launch of a study command: experiment.yaml written into the report directory, the clock, the end of its
    time (`max_minutes`; 0: none, on the monotonic clock), and where its time went."""

    def __init__(self, study: Study) -> None:
        out = Path(study.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "experiment.yaml").write_text(yaml.safe_dump(dataclasses.asdict(study), sort_keys=False))
        self.study, self.started = study, time.perf_counter()
        self.end = time.monotonic() + 60 * study.max_minutes if study.max_minutes else None
        self.trained: list[PlannedRun] = []
        self.train_wall: dict[str, float] = {}  # seconds of each run trained now
        self.eval_wall = 0.0  # seconds of the evaluations, over every launch

    def check_time(self, what: str, takes: float = 0.0) -> None:
        """Stop the study when too little time is left to begin `what` (`takes` seconds, as its likes took)."""
        reserve = max(min(STARTUP_RESERVE_S, 6 * self.study.max_minutes), takes)
        if self.end is not None and time.monotonic() + reserve >= self.end:
            stop = TrainingStopped("Time limit (--max_minutes) reached;", TIME_LIMIT_EXIT)
            raise stopped_study(stop, f"before {what}")

    def train(
        self,
        data_for: Callable[[RunConfig], TrainingData] | None = None,
        vocab_size: int | None = None,
        shorter: tuple[str, int] | None = None,
    ) -> list[PlannedRun]:
        """Print the plan and its estimate, then train every model with every seed within what is left of the time,
        reusing finished runs and resuming interrupted ones; `data_for` gives a run's data (default: its corpus)."""
        from posgpt.training.run import corpus_data, preflight, prepared_data, train  # Lightning: not for the --help

        out_dir, plan = self.study.out_dir, self.trained
        for seed in self.study.seeds:  # seeds outer, so that a partial study has whole seeds
            for variant in self.study.models():
                cfg = run_config_for(self.study.run, out_dir, variant, seed)
                ckpt = Path(cfg.train.out_dir) / cfg.train.run_name / "last.ckpt"
                step = int(read_checkpoint(ckpt, mmap=True).get("global_step", 0)) if ckpt.is_file() else 0
                plan.append(PlannedRun(variant.name, cfg.train.run_name, cfg, ckpt, step))
        if data_for is None:  # tokenizer, weights, resume: checked before the corpus is prepared
            for planned in (p for p in plan if not p.done):
                preflight(planned.config, resuming=planned.step > 0)
        progress = TrainingEstimate(plan, vocab_size)
        print(describe(plan, progress, shorter), flush=True)
        wall, prepared = self.train_wall, None
        for k, planned in enumerate(plan, 1):
            name = planned.name
            if planned.done:
                log.info(progress_line(k, len(plan), [f"{name} trained already, reused ({planned.ckpt})"], None, "run"))
                continue
            self.check_time(f"run {k} of {len(plan)}, {name}")
            start = f" from step {planned.step}" if planned.step else ""
            log.info(progress_line(k, len(plan), [f"training {name}{start}"], None, "run"))
            resume = "auto" if planned.step else None  # a run with no checkpoint yet starts afresh, and quietly
            # what is left of the time, in minutes: 0 for no limit (as train.max_minutes reads it), a tiny positive
            # number once it has passed (the run then stops at its first step)
            left = 0.0 if self.end is None else max(1e-3, (self.end - time.monotonic()) / 60)
            cfg = dataclasses.replace(planned.config, train=dataclasses.replace(
                planned.config.train, max_minutes=left, resume=resume))  # fmt: skip
            flops, t0 = progress.left(planned), time.perf_counter()
            try:
                if data_for is None:  # the study's corpus, prepared (and said so) once
                    prepared = prepared or prepared_data(cfg.data)
                train(cfg, data_for(cfg) if data_for else corpus_data(cfg, prepared))
            except TrainingStopped as stop:
                raise stopped_study(stop, f"run {k} of {len(plan)}, {name}") from None
            except CheckpointError as error:
                raise CheckpointError(f"{error} (runs are reused from {Path(out_dir) / 'runs'}; choose another "
                                      "out_dir to start afresh)") from None  # fmt: skip
            wall[name] = round(time.perf_counter() - t0, 1)
            planned.step = cfg.train.max_steps
            progress.finished(wall[name], flops)
            todo = [r for r in plan[k:] if not r.done]
            parts = [f"{name} trained in {format_seconds(wall[name])}"] + ([f"{len(todo)} left"] if todo else [])
            log.info(progress_line(k, len(plan), parts, progress.estimate(todo) if todo else None, "run"))
        return plan

    def evaluate(self, kind: str, key: dict[str, Any], evaluate: Callable[[PlannedRun], Any]) -> list[Any]:
        """`evaluate(run)` for every run, each kept in <run dir>/<kind>-<hash of key and checkpoint>.json, so that
        an interrupted study keeps what it evaluated; stops (exit 75) when too little time is left for the next
        (1.25 times the longest so far: one cannot stop halfway). Returns the results."""
        results, longest = [], 0.0
        for k, run in enumerate(self.trained, 1):
            stat = run.ckpt.stat()  # the stat tells the checkpoint from another at the same path
            run_key = {**key, "checkpoint": {"path": str(run.ckpt.resolve()), "bytes": stat.st_size,
                                             "mtime_ns": stat.st_mtime_ns, "git": git_sha()}}  # fmt: skip
            digest = hashlib.sha256(json.dumps(run_key, sort_keys=True, default=str).encode()).hexdigest()[:16]
            path = run.ckpt.parent / f"{kind}-{digest}.json"
            if path.is_file():
                stored = json.loads(path.read_text())
                result, took = stored["result"], stored["seconds"]
            else:
                started = time.perf_counter()
                self.check_time(f"evaluating {k} of {len(self.trained)}, {run.label} seed {run.seed}", 1.25 * longest)
                log.info("evaluating %d of %d: %s seed %d", k, len(self.trained), run.label, run.seed)
                result, took = evaluate(run), round(time.perf_counter() - started, 1)
                payload = {"key": run_key, "seconds": took, "result": result}
                atomic_write_bytes(path, json.dumps(payload, indent=1).encode())
            results.append(result)
            self.eval_wall, longest = self.eval_wall + took, max(longest, took)
        return results

    def finish(self, doc: dict[str, Any], write: Callable[[dict[str, Any], str], object]) -> dict[str, Any]:
        """`doc` with its `experiment` entry (the resolved config, every run's steps, tokens and time, and where this
        command's time went), written by `write` into the report directory and printed."""
        doc["experiment"] = wall = {
            "config": dataclasses.asdict(self.study),
            "runs": [run_record(r) for r in self.trained],
            "train_wall_s": self.train_wall,
            "eval_wall_s": round(self.eval_wall, 1),
            "total_wall_s": round(time.perf_counter() - self.started, 1),
        }
        write(doc, self.study.out_dir)
        out = Path(self.study.out_dir)
        print((out / "results.md").read_text())
        print(f"report in {out} (this command: training {sum(wall['train_wall_s'].values()):.0f} s, evaluation "
              f"{wall['eval_wall_s']:.0f} s, total {wall['total_wall_s']:.0f} s)")  # fmt: skip
        return doc
