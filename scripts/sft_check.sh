#!/usr/bin/env bash
# The chat fine-tuning check on a GPU, in one device call: tests/data/chat_small.jsonl through
# scripts/prepare_data.py (tokens and loss masks), d12 trained on it from scratch with --sft for 300 steps of two
# micro-batches each (a checkpoint at step 150), then the same command resumed from that checkpoint in a second
# folder. Prints the loss on assistant tokens (main.log's trl under --sft) at steps 1, 100, 200 and 300, and
# checks that it fell and that the resumed run's main.log lines (steps 150-299) and final weights and moments
# are the uninterrupted run's, bit for bit. Run from anywhere on the GPU machine:
#   TOKENIZER=path/to/tokenizer.model bash scripts/sft_check.sh [more train_llama.py arguments, e.g. --dtype fp8]
# TOKENIZER defaults to the per-user cache's tokenizer/tokenizer.model ($LLAMA_CUDA_CACHE, else
# $XDG_CACHE_HOME/llama-cuda, else ~/.cache/llama-cuda); the lent GPU machines reach no package index, so carry
# the file there. The runs go to a new folder under /tmp, named first; with $OUT set, the two main.log's and
# the trainers' output are copied there. Exit status 0 when every check passes, 1 otherwise. Needs nvidia-smi and
# pycuda (scripts/gpu_check.sh's header has the carried wheels); where one is missing it says so in one line.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/require.sh
require_commands "this runs on a machine with an NVIDIA GPU and its driver" nvidia-smi
require_modules "$CARRIED_WHEELS" pycuda.driver
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cache=${LLAMA_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-cuda}
tokenizer=${TOKENIZER:-$cache/tokenizer/tokenizer.model}
if [ ! -f "$tokenizer" ]; then
  echo "$(basename "$0"): no Llama 3 tokenizer at $tokenizer (chat data needs it): set TOKENIZER to a" \
       "tokenizer.model (python3 scripts/download_starter_pack.py fetches one into the cache)" >&2
  exit 1
fi
work=$(mktemp -d /tmp/sft_check.XXXXXX)
echo "runs in $work"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

python3 scripts/prepare_data.py tests/data/chat_small.jsonl --name chat_small --out-dir "$work/data" --val-every 0 \
  --tokenizer "$tokenizer"
train=(python3 train_llama.py -e d12 -b 4 -t 256 -d 2048 -x 300 -n 150 -nk 0 -v 0 -s 0 --sft
       --tokenizer "$tokenizer" -i "$work/data/chat_small_train_*.bin" "$@")
"${train[@]}" -o "$work/full" > "$work/full.out"
checkpoint=$work/full/ckpt_00000150
if [ ! -f "$checkpoint/DONE" ]; then
  echo "$(basename "$0"): the run wrote no checkpoint at step 150 ($work/full.out has its output)" >&2
  exit 1
fi
mkdir "$work/resumed"
cp -r "$checkpoint" "$work/resumed/"
"${train[@]}" -o "$work/resumed" --resume > "$work/resumed.out"
if [ -n "${OUT:-}" ]; then
  cp "$work/full/main.log" "$OUT/full_main.log"
  cp "$work/resumed/main.log" "$OUT/resumed_main.log"
  cp "$work/full.out" "$work/resumed.out" "$OUT/"
fi

python3 - "$work" <<'EOF'
"""The checks: the loss on assistant tokens at steps 1, 100, 200, 300, and the resume bit for bit."""
import filecmp
import sys
from pathlib import Path

from llama.data.shards import mask_path, open_mask, open_shard

work = Path(sys.argv[1])


def train_lines(folder):
    """main.log's train lines by step (main.log counts from 0: s:0 is step 1)."""
    lines = (work / folder / "main.log").read_text().splitlines()
    return {int(line.split()[0][2:]): line for line in lines if " trl:" in line}


shard = work / "data" / "chat_small_train_000000.bin"
counted = open_mask(mask_path(shard), len(open_shard(shard)))
print(f"tokens counted in the loss (assistant replies and their <|eot_id|>): {int(counted.sum()):,} of "
      f"{counted.size:,} ({counted.mean():.1%})")
full, resumed = train_lines("full"), train_lines("resumed")
loss = {step + 1: float(full[step].split("trl:")[1].split()[0]) for step in (0, 99, 199, 299)}
print("loss on assistant tokens: " + ", ".join(f"step {step} {value:.4f}" for step, value in loss.items()))
failures = []
if not loss[300] < loss[100] < loss[1]:
    failures.append("the loss on assistant tokens did not fall from step 1 to 100 to 300")
if sorted(resumed) != list(range(150, 300)):
    failures.append(f"the resumed run logged steps {min(resumed)}-{max(resumed)}, not 150-299")
differing = [step for step in resumed if resumed[step] != full.get(step)]
if differing:
    failures.append(f"main.log differs from step {differing[0]}: {full.get(differing[0])!r} against "
                    f"{resumed[differing[0]]!r}")
for name in ("model.safetensors", "optimizer.safetensors"):
    a, b = (work / run / "ckpt_00000300" / name for run in ("full", "resumed"))
    if not filecmp.cmp(a, b, shallow=False):
        failures.append(f"ckpt_00000300/{name} differs between the runs")
if not failures:
    print(f"resume from step 150: main.log steps 150-299 ({len(resumed)} lines), weights and moments at step 300 "
          "identical bit for bit")
for failure in failures:
    print(f"FAILED: {failure}", file=sys.stderr)
sys.exit(1 if failures else 0)
EOF
