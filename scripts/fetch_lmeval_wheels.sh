#!/usr/bin/env bash
# Download the wheels that let lm-evaluation-harness (lm_eval 0.4.13: its HFLM, and its task YAMLs rendered by its
# Jinja templates) run on the lent GPU machines, which reach no package index, into .whl-lmeval/ (git-ignored; 4
# wheels, about 9.5 MB): the exact versions below, for CPython 3.12 on x86-64 Linux (the machines' Python).
# scripts/check_eval_lmeval.py's docstring says why these and why this version of lm_eval. Run it where PyPI is
# reachable, from anywhere:
#   bash scripts/fetch_lmeval_wheels.sh [FOLDER]
# The folder's old wheels are removed first: two versions of one package would stop the install there.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl-lmeval}
WHEELS=(lm_eval==0.4.13 accelerate==1.15.0 jinja2==3.1.6 markupsafe==3.0.3)
mkdir -p "$dest"
rm -f "$dest"/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${WHEELS[@]}"
count=$(find "$dest" -maxdepth 1 -name '*.whl' | wc -l)
expected=${#WHEELS[@]}
if [ "$count" -ne "$expected" ]; then
  echo "$(basename "$0"): $dest holds $count wheels; expected $expected" >&2
  exit 1
fi
echo "$count wheels, $(du -sh "$dest" | cut -f1), in $dest; on the GPU machine (carry $dest):"
echo "  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl $dest/*.whl"
