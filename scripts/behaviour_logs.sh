#!/usr/bin/env bash
# The runs whose main.log a change that keeps behaviour (a refactor, a move) must leave the same, bit for bit:
# each run's main.log is copied to OUT/<name>.log. Record them on the tree before the change and on the tree after,
# then `scripts/behaviour_logs.sh --compare BEFORE AFTER`, which says of each main.log whether it is the same, bit for
# bit (each run's output, with its timings, is kept beside it as NAME.out).
#   bash scripts/behaviour_logs.sh OUT [cpu|gpu|all]      (default: gpu where nvidia-smi answers, else cpu)
# cpu: the default preset (-x 50, seed 0) and --sft on tests/data/chat_small.jsonl, on the numpy reference.
# gpu: d12 for 50 steps with --dtype bf16, fp8 and fp32, and bf16 with --recompute full --optimizer-in-backward.
# TOKENIZER: the Llama 3 tokenizer.model to use (default: the per-user cache's); a run never fetches it.
set -euo pipefail
if [ "${1:-}" = "--compare" ]; then
  differ=0
  for log in "$2"/*.log; do
    if cmp -s "$log" "$3/$(basename "$log")"; then echo "same: $(basename "$log")"; else echo "DIFFER: $(basename "$log")"; differ=1; fi
  done
  exit $differ
fi
out=${1:?usage: behaviour_logs.sh OUT [cpu|gpu|all]   or   behaviour_logs.sh --compare BEFORE AFTER}
which=${2:-$(command -v nvidia-smi > /dev/null && echo gpu || echo cpu)}
out=$(mkdir -p "$out" && cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cache=${LLAMA_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-cuda}
tokenizer=${TOKENIZER:-$cache/tokenizer/tokenizer.model}
work=$(mktemp -d /tmp/behaviour.XXXXXX)

run() {  # run NAME ARGS...: one training run in its own folder, its main.log kept as OUT/NAME.log
  local name=$1
  shift
  python3 train_llama.py --tokenizer "$tokenizer" --seed 0 -o "$work/$name" "$@" > "$out/$name.out" 2>&1
  cp "$work/$name/main.log" "$out/$name.log"
  echo "$name: $(tail -n 1 "$out/$name.log")"
}

if [ "$which" = cpu ] || [ "$which" = all ]; then
  run cpu_default --device cpu -x 50
  python3 scripts/prepare_data.py tests/data/chat_small.jsonl --name chat --out-dir "$work/chat" --val-every 0 \
    --tokenizer "$tokenizer" > "$out/prepare_chat.out" 2>&1
  run cpu_sft --device cpu -x 20 -t 128 --sft -i "$work/chat/chat_train_*.bin"
fi
if [ "$which" = gpu ] || [ "$which" = all ]; then
  for dtype in bf16 fp8 fp32; do
    run "d12_$dtype" -e d12 -x 50 --dtype "$dtype"
  done
  run d12_full_in_backward -e d12 -x 50 --recompute full --optimizer-in-backward
fi
rm -rf "$work"
