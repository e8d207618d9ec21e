#!/usr/bin/env bash
# One-shot check of the CUDA backend on a GPU machine: versions, the GPU tests (kernels at real
# shapes, graph replay), then the CUDA benchmarks (HBM copy/saxpy, expert MLP eager vs graph,
# one decoder layer eager vs graph). Logs and bench.json go to $OUT (default ./gpu_out).
# Run from the repository root: bash tools/gpu_check.sh
set -euo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD

echo "== versions"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
python3 -c "import sys, numpy, numba, numba_cuda, cuda.bindings; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cuda-bindings', cuda.bindings.__version__)"
python3 -c "from numba import cuda; d = cuda.get_current_device(); print(d.name, d.compute_capability, 'SMs', d.MULTIPROCESSOR_COUNT)"

echo "== GPU tests"
rc_tests=0
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_kernels.py \
    tests/test_graphs.py 2>&1 | tee "$OUT/pytest.log" || rc_tests=$?
echo "pytest exit: $rc_tests"

echo "== benchmarks"
rc_bench=0
timeout 240 python3 asv_bench/benchmarks/bench_cuda.py "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" \
    || rc_bench=$?
echo "bench exit: $rc_bench"
exit $(( rc_tests != 0 || rc_bench != 0 ))
