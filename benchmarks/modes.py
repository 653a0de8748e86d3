"""The benchmark modes of `python bench.py MODE` / `posgpt bench MODE`, whose figures go into BENCHMARKS.md.

    bench.py gpu [--schemes rope alibi --shapes 16x1024 4x4096 --json rows.jsonl]
    bench.py decode [--schemes learned rope alibi --batches 1 64 --modes eager compiled --json rows.jsonl]
    bench.py vs-nanogpt --peer ../shared/peers/nanoGPT --input ../shared/data/tinyshakespeare.txt --shape cpu
    bench.py report [--part check train decode long] [--out bench-report.jsonl] [--render FILE]
    bench.py syncs --input ../shared/data/tinyshakespeare.txt
    bench.py memory [--lengths 1024 2048]
    bench.py attention-cost [--functions softmax linear gated_deltanet kda --lengths 1024 4096 16384]

`bench.py MODE --help` lists a mode's options and what it measures.
"""

from __future__ import annotations

from posgpt.core.modes import Lazy, Modes

DESCRIPTION = __doc__
MODES: Modes = {
    "decode": Lazy(
        "posgpt.benchmarks.decoding",
        "Decoding per scheme, eager and compiled, against nanoGPT's generate; CPU or GPU.",
    ),
    "gpu": Lazy(
        "posgpt.benchmarks.gpu",
        "Training tokens/s, MFU, peak memory and compile time per scheme and shape; the Lightning trainer's overhead; "
        "nanoGPT's step beside ours.",
    ),
    "vs-nanogpt": Lazy("posgpt.benchmarks.nanogpt", "Our train.py against nanoGPT's, per-step cost, CPU."),
    "report": Lazy(
        "posgpt.benchmarks.report",
        "What this machine does with posgpt: kernel checks, training, decoding and long-context speed, one job "
        "per process, each line of --out written as it finishes, and a markdown report of them.",
    ),
    "memory": Lazy("posgpt.benchmarks.memory", "Training memory per scheme against RoPE's, counted."),
    "attention-cost": Lazy(
        "posgpt.benchmarks.attention_cost", "One attention call's forward and backward against T, CPU."
    ),
    "syncs": Lazy("posgpt.benchmarks.syncs", "Host syncs per training step, ops a decoded token, counted."),
}
"""Each mode's module, imported when it runs, and its line in `bench.py --help` (tests/test_entry_points.py)."""
