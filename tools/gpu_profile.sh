#!/usr/bin/env bash
# GPU machine: the HBM copy figure both ways, then Qwen3-30B-A3B shapes (NVFP4): all-resident
# decode, its op profile, uniform streaming with the experts warm in RAM, the streamed decode
# with the model's routing (one graph a token and the per-layer path), GPU engine tests, the NVFP4
# expert kernel sweep (VARIANTS, comma list); logs to $OUT. TAG names a run's bench / op files (an
# A/B under MOE_STREAM_NVFP4_VARIANT, say).
# usage (device tool, carry [".whl"]): bash tools/gpu_profile.sh [STEPS] (default "hbm bench op uniform")
set -o pipefail
[ -d /tmp/site/numpy ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-hbm bench op uniform}
for s in $STEPS; do
  echo "== $s at ${SECONDS}s"
  case $s in
    hbm) python3 - <<'PY' 2>&1 | grep -v -i warn | tee "$OUT/hbm.txt"
import time
from numba import cuda
from engine.bandwidth import hbm_gbps
n = 1 << 30
a, b = cuda.device_array(n, "u1"), cuda.device_array(n, "u1")
s = cuda.stream()
b.copy_to_device(a, stream=s); s.synchronize()
host = []
for _ in range(5):
    t = time.perf_counter(); b.copy_to_device(a, stream=s); s.synchronize()
    host.append(2 * n / (time.perf_counter() - t) / 1e9)
print(f"host-timed synchronized copies (old method): best {max(host):.0f} GB/s, all {[round(x) for x in host]}")
print(f"event-timed back to back (engine.bandwidth.hbm_gbps): {hbm_gbps():.0f} GB/s")
PY
    ;;
    synth) [ -d /tmp/q30 ] || python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1 ;;
    bench) [ -d /tmp/q30 ] || python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1
       python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 40 --ram-gb 32 --tokens 128 \
         --prompt-len 2048 --out "$OUT/resident$TAG.json" 2>&1 | grep -v -i warn | tail -15 | tee "$OUT/resident$TAG.log" ;;
    op) python3 tools/op_profile.py /tmp/q30 --vram-gb 40 --prompt-len 2048 --out "$OUT/op$TAG.json" 2>&1 \
         | grep -v -i warn | tail -40 | tee "$OUT/op$TAG.log" ;;
    sweep) timeout ${SWEEP_S:-300} python3 tools/sweep_experts.py "$OUT/sweep.json" --formats nvfp4 \
         --variants "${VARIANTS:-mma-g4-d4-p3-c,mma-g4-d4-p5-c-l}" 2>&1 | grep -v -i warn | tail -30 | tee "$OUT/sweep.log" ;;
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_engine.py \
         -k "streaming or graph_replay or device_sampling" 2>&1 | tail -15 | tee "$OUT/tests.log" ;;
    stream) [ -d /tmp/q30 ] || python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1
       for d in ${DEVRES:-1 0}; do
         MOE_STREAM_DEVICE_RESOLVE=$d python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 \
           --ram-gb 32 --warm-ram --tokens ${TOK:-128} --prompt-len ${PROMPT:-512} \
           --out "$OUT/stream$d.json" 2>&1 | grep -v -i warn | tail -3 | tee "$OUT/stream$d.log"
       done ;;
    gather) for g in ${GATHER:-1 0}; do   # the RAM hits gathered by the token graph, or copied by the host
         MOE_STREAM_DEVICE_GATHER=$g python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 \
           --ram-gb 32 --warm-ram --route uniform --tokens 64 --prompt-len 512 \
           --out "$OUT/uniform_g$g.json" 2>&1 | grep -v -i warn | tail -4 | tee "$OUT/uniform_g$g.log"
         MOE_STREAM_DEVICE_GATHER=$g python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 \
           --ram-gb 32 --warm-ram --tokens 128 --prompt-len 512 \
           --out "$OUT/stream_g$g.json" 2>&1 | grep -v -i warn | tail -3 | tee "$OUT/stream_g$g.log"
       done ;;
    uniform) python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 --ram-gb 32 --warm-ram \
         --route uniform --tokens 64 --prompt-len 512 --profile --out "$OUT/uniform.json" 2>&1 \
         | grep -v -i warn | tail -25 | tee "$OUT/uniform.log" ;;
  esac
done
echo "done at ${SECONDS}s"
