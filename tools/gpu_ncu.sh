#!/usr/bin/env bash
# GPU machine: Nsight Compute over one decoder layer's kernels (tools/ncu_layer.py), the clocks
# left alone. Reports to $OUT: ncu_layer.txt (details of every kernel), ncu_src_*.csv (SASS with
# per-instruction stall counts of the kernels named in SRC, a regex).
# usage (device tool, carry [".whl"]): bash tools/gpu_ncu.sh
set -o pipefail
[ -d /tmp/site/numpy ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
echo "ncu: $NCU"; "$NCU" --version | tail -1
SECS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis"
timeout ${NCU_S:-240} "$NCU" --clock-control none --profile-from-start off $SECS -f -o "$OUT/layer" python3 tools/ncu_layer.py 2>&1 | grep -v -i warn | tail -20
"$NCU" --import "$OUT/layer.ncu-rep" --page details > "$OUT/ncu_layer.txt" 2>&1
"$NCU" --import "$OUT/layer.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size > "$OUT/ncu_summary.csv" 2>&1
python3 - "$OUT/ncu_summary.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[0]
want = ["Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
        "launch__grid_size", "launch__block_size"]
idx = [hdr.index(w) for w in want if w in hdr]
print(" | ".join(hdr[i][:28] for i in idx))
for r in rows[2:]:
    print(" | ".join((r[i][:40] if i == idx[0] else r[i]) for i in idx))
PY
SRC=${SRC:-gate_up|down|partial2|one}
timeout ${NCU_S:-240} "$NCU" --clock-control none --profile-from-start off -k "regex:$SRC" --section WarpStateStats --section SourceCounters -f -o "$OUT/src" python3 tools/ncu_layer.py > /dev/null 2>&1
"$NCU" --import "$OUT/src.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_src.csv" 2>&1
ls -la "$OUT"; echo "done at ${SECONDS}s"
