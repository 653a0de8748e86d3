#!/usr/bin/env bash
# The wheel alone, outside any checkout: build it from this tree's files, install it with --no-deps into a folder of
# its own (a venv made from this venv with --system-site-packages would see the base interpreter's packages, not
# this venv's), and from an empty directory, with only that folder added to the path, run a tiny real run of every
# posgpt mode a CPU runs, in one process (a process per mode would spend most of the time importing torch and
# Lightning); the console script that pip wrote prints the modes. About 45 s on 2 busy cores (docs/development.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# a copy of the files git tracks or would track (a build/ of the tree itself could hold stale modules)
mkdir "$tmp/src" "$tmp/work"
git -C "$root" ls-files -z --cached --others --exclude-standard \
    | (cd "$root" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$tmp/src"
python -m pip wheel -q --no-deps -w "$tmp/wheel" "$tmp/src"
python -m pip install -q --no-deps --no-compile --target "$tmp/site" "$tmp"/wheel/posgpt-*.whl
cd "$tmp/work"
export PYTHONPATH="$tmp/site" WANDB_MODE=disabled
"$tmp/site/bin/posgpt" --help | grep "bench " > /dev/null  # (not -q: grep reads it all, no broken pipe)
python - "$tmp/site" <<'PY'
import sys
import time
from pathlib import Path

import posgpt
from posgpt.cli import main

assert Path(posgpt.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), posgpt.__file__
Path("corpus.txt").write_text("".join(f"{i} To be, or not to be, that is the question: whether tis nobler\n"
                                      for i in range(400)))  # fmt: skip
tiny = "--train.batch_size 4 --train.eval_tokens 256 --train.precision 32-true --train.logger csv"
run = f"--run.model.n_layer 1 --run.model.n_embd 32 --run.model.block_size 16 {tiny.replace('--', '--run.')} " \
      "--run.train.max_steps 4 --run.train.eval_interval 4"
ckpt = "runs/tiny/last.ckpt"
for line in [
    f"train --model.n_layer 1 --model.n_head 2 --model.n_embd 32 --model.block_size 32 {tiny} --train.max_steps 8 "
    "--train.eval_interval 8 --train.sample_tokens 0 --train.progress_bar false --data.input corpus.txt "
    "--data.prepared_root prepared --train.out_dir runs --train.run_name tiny",
    f"sample --ckpt {ckpt} --prompt To --max_new_tokens 8",
    f"evaluate --ckpt {ckpt} --out eval --eval.lengths [16,64] --eval.token_budget 64 --eval.progress false",
    f"attention --ckpt {ckpt} --out maps --prompt To --lengths [16] --tokens 32 --progress false",
    "prepare --inputs corpus.txt --out_dir prepared/again",
    "plot --run_dir runs/tiny",
    f"study extrapolation --config configs/extrapolation_quick.yaml --out_dir study --schemes [rope] --seeds [1] "
    f"--run.data.input corpus.txt --run.data.prepared_root prepared {run} --eval.lengths [16,32] "
    "--eval.token_budget 32 --eval.progress false",
    f"study synthetic --config configs/synthetic_copy.yaml --out_dir synthetic --task.train_min 6 "
    f"--task.train_max 6 --task.eval_lengths [6,12] --task.test_size 2 --schemes [alibi] --variants [] --seeds [1] {run}",
    "bench syncs --input corpus.txt --steps 1 --log_interval 1",
    "bench memory --lengths [16] --rows [rope]",
    "bench decode --shape tiny --batches [1] --tokens 4 --modes [eager] --schemes [learned] --peer none",
    "check --quick --device cpu --only softmax/rope",
]:
    start = time.perf_counter()
    try:
        main(line.split())
    except SystemExit as stop:
        if stop.code:
            raise SystemExit(f"posgpt {line}: exit status {stop.code}") from None
    print(f"--- posgpt {line.split(' --')[0]}: {time.perf_counter() - start:.1f} s", flush=True)
PY
