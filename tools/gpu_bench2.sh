#!/usr/bin/env bash
# GPU machine: the gpu tests, then Qwen3-30B-A3B shapes (NVFP4) under budgets with the model's own
# routing and with uniform routing (forces streaming); logs and JSON to $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py -x --timeout 300 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1
python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 --ram-gb 32 --resident-vram-gb 40 \
    --tokens 128 --prompt-len 2048 --out "$OUT/q30_model.json" 2>&1 | grep -v -i warn | tee "$OUT/bench_model.log"
python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 --ram-gb ${RAMS:-32 8 4} --route uniform \
    --tokens ${TOK:-128} --prompt-len 2048 --out "$OUT/q30_uniform.json" 2>&1 | grep -v -i warn | tee "$OUT/bench_uniform.log"
