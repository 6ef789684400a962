#!/usr/bin/env bash
# d12 trained briefly with the in-loop evaluation on the next-line task (scripts/make_next_line_task.py, 1000
# items of the trainer's validation text): prints README's table of step, validation loss, acc and acc_norm, the
# accuracy of the random init at step 0 and then every EVERY steps. Under 2 minutes on one H100 (600 steps at
# d12's ~50 ms, 7 evaluations). Run from the repository root on the GPU machine, where the tokenizer and the
# shards lie in the per-user cache or in a folder named by LLAMA_CUDA_CACHE (for the lent machines: data/, carried):
#   LLAMA_CUDA_CACHE=data bash scripts/eval_curve.sh
# The data is the trainer's with no data arguments: the starter pack's tinyshakespeare when downloaded, else the
# built-in corpus; the first line says which. STEPS (600) and EVERY (100) change the schedule; the task, main.log,
# the training output and the table go to $OUT (default /tmp/eval_curve).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/require.sh
require_commands "this runs on a machine with an NVIDIA GPU and its driver" nvidia-smi
require_modules "$CARRIED_WHEELS" pycuda.driver
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/eval_curve}
steps=${STEPS:-600}
every=${EVERY:-100}
run=$(mktemp -d)/d12  # the checkpoints stay out of $OUT
mkdir -p "$out"
began=$SECONDS
python3 scripts/make_next_line_task.py --out "$out/next_line.jsonl"
python3 train_llama.py -e d12 -b 16 -t 1024 -x "$steps" -v "$every" -m 10 -s 0 -n 0 -o "$run" \
  --eval "$out/next_line.jsonl" --eval-every "$every" > "$out/train.log" 2>&1 || { tail -20 "$out/train.log"; exit 1; }
cp "$run/main.log" "$out/main.log"
python3 - "$out/main.log" <<'EOF' | tee "$out/table.md"
import sys
sys.path.insert(0, "scripts")
from plot_log import EVAL_LINE, read_log

_, val = read_log(sys.argv[1])
print("| step | val loss | acc | acc_norm |\n|---:|---:|---:|---:|")
for line in open(sys.argv[1]):
    if m := EVAL_LINE.match(line):
        step = int(m[1])
        print(f"| {step} | {val[step]:.3f} | {float(m[3]):.3f} | {float(m[4]):.3f} |")
EOF
echo "d12, $steps steps of 16 x 1024 tokens, in $((SECONDS - began)) s; chance is 0.25; $(grep -m1 "^data:" "$out/train.log")"
