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

Each mode is a dataclass of options and a function in `benchmarks/` (training.py: the trainer against a
hand-written loop; decoding.py: decode speed per scheme, eager and compiled, against nanoGPT's generate;
gpu.py: training speed per scheme and shape, bare step, trainer and nanoGPT's step; nanogpt.py: our
train.py against nanoGPT's; precision.py: float32 against bf16, clipping and AdamW; attention.py:
attention kinds and variants); `bench.py MODE --help` lists a mode's options and what it measures.
"""

from __future__ import annotations

from benchmarks.attention import ATTENTION_COST, VARIANT_STEP
from benchmarks.decoding import DECODE
from benchmarks.gpu import GPU
from benchmarks.nanogpt import VS_NANOGPT
from benchmarks.precision import CLIP, PRECISION
from benchmarks.training import PLAIN_RUN, TRAIN_STEP, VAL_NOISE

DESCRIPTION = __doc__
MODES = {
    "train-step": TRAIN_STEP,
    "plain-run": PLAIN_RUN,
    "val-noise": VAL_NOISE,
    "decode": DECODE,
    "gpu": GPU,
    "vs-nanogpt": VS_NANOGPT,
    "precision": PRECISION,
    "clip": CLIP,
    "attention-cost": ATTENTION_COST,
    "variants": VARIANT_STEP,
}
