"""The benchmark modes of `python bench.py MODE` / `posgpt bench MODE`, whose figures go into BENCHMARKS.md.

    bench.py train-step --input ../shared/data/tinyshakespeare.txt [--steps 300 --rounds 2]
    bench.py plain-run --input ../shared/data/tinyshakespeare.txt --seeds 1337 1 2
    bench.py val-noise --ckpt runs/X/last.ckpt --data_dir prepared/Y
    bench.py gpu [--schemes rope alibi --shapes 16x1024 4x4096 --json rows.jsonl]
    bench.py decode [--schemes learned rope alibi --batches 1 64 --modes eager compiled --json rows.jsonl]
    bench.py vs-nanogpt --peer ../shared/peers/nanoGPT --input ../shared/data/tinyshakespeare.txt --shape cpu
    bench.py precision [--steps 20] [--profile 4 128 64 12]
    bench.py clip [--steps 100]
    bench.py attention-cost [--lengths 1024 4096 16384]
    bench.py variants [--names rope learned alibi]
    bench.py report [--part check train decode long] [--out bench-report.jsonl] [--render FILE]

Each mode is a dataclass of options and a function in `benchmarks/` (training.py: the trainer against a
hand-written loop; decoding.py: decode speed per scheme, eager and compiled, against nanoGPT's generate;
gpu.py: training speed per scheme and shape, bare step, trainer and nanoGPT's step; nanogpt.py: our
train.py against nanoGPT's; precision.py: float32 against bf16, clipping and AdamW; attention.py:
attention kinds and variants); `bench.py MODE --help` lists a mode's options and what it measures.
"""

from __future__ import annotations

from core.modes import Lazy, Modes

DESCRIPTION = __doc__
MODES: Modes = {
    "train-step": Lazy(
        "benchmarks.training", "TRAIN_STEP", "Lightning trainer vs a hand-written loop, tokens/s on CPU."
    ),
    "plain-run": Lazy("benchmarks.training", "PLAIN_RUN", "A whole run of the hand-written loop: val loss per seed."),
    "val-noise": Lazy(
        "benchmarks.training", "VAL_NOISE", "Spread of nanoGPT's 20-batch val estimate for a checkpoint."
    ),
    "decode": Lazy(
        "benchmarks.decoding",
        "DECODE",
        "Decoding per scheme, eager and compiled, against nanoGPT's generate; CPU or GPU.",
    ),
    "gpu": Lazy(
        "benchmarks.gpu",
        "GPU",
        "Training tokens/s, MFU, peak memory and compile time per scheme and shape; the Lightning trainer's overhead; "
        "nanoGPT's step beside ours.",
    ),
    "vs-nanogpt": Lazy("benchmarks.nanogpt", "VS_NANOGPT", "Our train.py against nanoGPT's, per-step cost, CPU."),
    "precision": Lazy("benchmarks.precision", "PRECISION", "float32 against bf16 autocast, ms per training step, CPU."),
    "clip": Lazy("benchmarks.precision", "CLIP", "The optimizer phase with and without clipping, fused or not, CPU."),
    "attention-cost": Lazy(
        "benchmarks.attention", "ATTENTION_COST", "fwd+bwd time and peak memory of attention kinds against T, CPU."
    ),
    "variants": Lazy(
        "benchmarks.attention", "VARIANT_STEP", "Training step of each attention variant, interleaved, CPU."
    ),
    "report": Lazy(
        "benchmarks.report",
        "REPORT",
        "What this machine does with posgpt: kernel checks, training, decoding and long-context speed, one job "
        "per process, each line of --out written as it finishes, and a markdown report of them.",
    ),
}
"""Each mode's module and its line in `bench.py --help`, imported when it runs (tests/test_entry_points.py
holds the lines to the commands' own descriptions)."""
