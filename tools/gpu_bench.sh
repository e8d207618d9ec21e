#!/usr/bin/env bash
# GPU machine: synthetic Qwen3-30B-A3B (NVFP4 experts) under VRAM/RAM budgets; logs to $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOK=${TOK:-128}; PROMPT=${PROMPT:-2048}
python3 -m engine.synth qwen3-30b-a3b /tmp/s4 --layers 4 --force 2>&1 | tail -1
python3 -m engine.bench gpu-stream --model /tmp/s4 --vram-gb 2 --ram-gb 0.5 --tokens 8 --prompt-len 64 2>&1 | tail -4 || exit 1
rm -rf /tmp/s4
python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1
python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 --ram-gb ${RAMS:-4 8 32} \
    --resident-vram-gb ${RESIDENT:-40} --tokens $TOK --prompt-len $PROMPT --out "$OUT/q30.json" 2>&1 \
    | grep -v Warning | tee "$OUT/bench.log"
