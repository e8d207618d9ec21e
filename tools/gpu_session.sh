#!/usr/bin/env bash
# The gpu tests on the GPU machine in one call of the device tool (10 minutes at most), logs in $OUT.
# usage (device tool, carry [".whl"], made by tools/fetch_wheels.sh): bash tools/gpu_session.sh GROUP
#   a: tests/test_gpu_engine.py then tests/test_families_cuda.py (new, duration unknown) beside
#      tests/test_gpu_hybrid.py then tests/test_fused_norm.py (engine 227 s, hybrid 238 s,
#      fused norm 195 s alone, on 2026-12-01)
#   b: tests/test_cuda_kernels.py's per-token expert tests (the live variants at three real
#      shapes) beside its dense / sampling tests and tests/test_graphs.py
#   c: the grouped (prefill) expert tests beside tests/test_attention_decode.py then
#      tests/test_kv_cache_bf16.py (b: 431 s; c's grouped tests 453 s; the bf16 cache tests
#      about 150 s on 2026-12-01)
#   e: tests/test_gpu_engine.py beside tests/test_gpu_hybrid.py (a without the families and the
#      fused norms: the engine's state paths, the prefix cache's among them)
#   f: the checkpoint formats on cuda: tests/test_int_checkpoint.py, tests/test_nvfp4_checkpoint.py
#      (not yet run, 2026-12-02)
#   ef: e and f side by side (three processes)
#   oss: gpt-oss on cuda (2026-12-05, not yet run): its families tests and the clamped experts
#      beside the attention tests (sinks at gpt-oss-120b's shapes) and the bf16 KV cache's
#   mla: DeepSeek-V2 / V3 on cuda (2026-12-05, not yet run): the MLA kernels at V2-Lite's and
#      V3's shapes beside the deepseek families tests, then a V2-Lite-shaped synthetic arena
#      streamed at --vram-gb 8 (engine.bench gpu-stream, RAM 8 and 32 GB)
#   new: the twentieth session's families on cuda (not yet run): MiniMax-M2, GLM-4.7-Flash,
#      Qwen3-VL-MoE, ERNIE-4.5 parity and graph replay, beside the kernels' router tests, then a
#      GLM-4.7-Flash-shaped synthetic arena streamed at --vram-gb 8 (RAM 8 and 32 GB)
# Both or all three of a group's processes run side by side: numba compiles on the CPU, so more
# than two or three at once slow each other down (four side by side each ran past 250 s on
# 2026-11-30; on 2026-12-01 b's two halves beside a third process each passed 331 s unfinished,
# and the grouped tests were then part of b). One group a call.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-540}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run() {   # run NAME PYTEST-ARGS...: one pytest process, its log (-v: a line a test, so a run cut
          # short by the limit still says which passed) and exit status in $OUT/NAME.log
    local name=$1
    shift
    timeout "$LIMIT" python3 -m pytest -v -p no:cacheprovider -m gpu -rfE --durations=5 "$@" \
        > "$OUT/$name.log" 2>&1
    echo -e "\nexit $? after ${SECONDS}s" >> "$OUT/$name.log"
}
case "${1:-a}" in
    a) { run engine tests/test_gpu_engine.py; run families tests/test_families_cuda.py; } &
       { run hybrid tests/test_gpu_hybrid.py; run fused tests/test_fused_norm.py; } & wait ;;
    b) run experts tests/test_cuda_kernels.py -k test_experts_gpu &
       run kernels tests/test_cuda_kernels.py tests/test_graphs.py \
           -k "not test_experts_gpu and not grouped" & wait ;;
    c) run grouped tests/test_cuda_kernels.py -k grouped &
       { run attention tests/test_attention_decode.py; run kv tests/test_kv_cache_bf16.py; } & wait ;;
    e) run engine tests/test_gpu_engine.py & run hybrid tests/test_gpu_hybrid.py & wait ;;
    f) run formats tests/test_int_checkpoint.py tests/test_nvfp4_checkpoint.py ;;
    ef) run engine tests/test_gpu_engine.py & run hybrid tests/test_gpu_hybrid.py &
        run formats tests/test_int_checkpoint.py tests/test_nvfp4_checkpoint.py & wait ;;
    oss) { run families tests/test_families_cuda.py -k gpt_oss
           run clamped tests/test_cuda_kernels.py -k clamped; } &
         { run attention tests/test_attention_decode.py; run kv tests/test_kv_cache_bf16.py; } &
         wait ;;
    mla) run mla tests/test_mla_cuda.py & run families tests/test_families_cuda.py -k deepseek &
         wait
         python3 -m engine.synth deepseek-v2-lite /tmp/dsl > "$OUT/dsl_bench.log" 2>&1 &&
             timeout 240 python3 -m engine.bench gpu-stream --model /tmp/dsl --vram-gb 8 \
                 --ram-gb 8 32 >> "$OUT/dsl_bench.log" 2>&1
         echo -e "\nexit $? after ${SECONDS}s" >> "$OUT/dsl_bench.log" ;;
    new) run families tests/test_families_cuda.py -k "minimax or lite or ernie" &
         run router tests/test_cuda_kernels.py -k router_sigmoid_gpu & wait
         python3 -m engine.synth glm-4.7-flash /tmp/glm > "$OUT/glm_bench.log" 2>&1 &&
             timeout 240 python3 -m engine.bench gpu-stream --model /tmp/glm --vram-gb 8 \
                 --ram-gb 8 32 >> "$OUT/glm_bench.log" 2>&1
         echo -e "\nexit $? after ${SECONDS}s" >> "$OUT/glm_bench.log" ;;
    s21) # every never-run family test, six processes, the synthetic arenas written beside them
         # for the benches of the next call (bench)
         { python3 -m engine.synth glm-4.7-flash /tmp/glm > "$OUT/synth.log" 2>&1
           python3 -m engine.synth deepseek-v2-lite /tmp/dsl >> "$OUT/synth.log" 2>&1; } &
         run fam1 tests/test_families_cuda.py -k "gpt_oss or minimax or ernie" &
         run fam2 tests/test_families_cuda.py -k "deepseek or lite" &
         run fam3 tests/test_families_cuda.py -k "glm4_moe and not lite or qwen2 or dots1" &
         { run mla tests/test_mla_cuda.py; run kern tests/test_cuda_kernels.py -k "clamped or router"; } &
         run attn tests/test_attention_decode.py -k sinks &
         run engine tests/test_gpu_engine.py &
         wait ;;
    s21b) # s21's tests that did not finish (ERNIE and MiniMax again after their fixes), three
         # processes, then the glm-4.7-flash bench in what is left of the call
         run fam1 tests/test_families_cuda.py -k "ernie or minimax" &
         run fam2 tests/test_families_cuda.py \
             -k "test_graph_replay_and_streaming and (gpt_oss or deepseek) or lite or dots1" &
         { run kern tests/test_cuda_kernels.py -k "clamped or router"
           run fam3 tests/test_families_cuda.py \
               -k "test_graph_replay_and_streaming and (glm4_moe or qwen2)"; } &
         wait
         if [ -z "$NO_BENCH" ] && [ $SECONDS -lt 420 ]; then
             { [ -d /tmp/glm ] || python3 -m engine.synth glm-4.7-flash /tmp/glm; } > "$OUT/glm_bench.log" 2>&1 &&
                 timeout $((575 - SECONDS)) python3 -m engine.bench gpu-stream --model /tmp/glm \
                     --vram-gb 8 --ram-gb 32 --tokens 64 --prompt-len 512 >> "$OUT/glm_bench.log" 2>&1
             echo -e "\nexit $? after ${SECONDS}s" >> "$OUT/glm_bench.log"
         fi ;;
    s21c) # the shortest check of the families fixed or never run on a GPU (about 200 s)
         run ernie tests/test_families_cuda.py -k ernie &
         run minimax tests/test_families_cuda.py -k "minimax and test_cuda_matches" &
         run oss tests/test_families_cuda.py -k "test_graph_replay_and_streaming and gpt_oss" &
         run dsv3 tests/test_families_cuda.py -k "test_graph_replay_and_streaming and deepseek" &
         wait ;;
    s22) # s21c, then the NVFP4 experts replayed from one layer (its weights stay in the L2) and
         # from 16 (read from HBM), alone, then the glm-4.7-flash bench in what is left
         run ernie tests/test_families_cuda.py -k ernie &
         run minimax tests/test_families_cuda.py -k "minimax and test_cuda_matches" &
         run oss tests/test_families_cuda.py -k "test_graph_replay_and_streaming and gpt_oss" &
         run dsv3 tests/test_families_cuda.py -k "test_graph_replay_and_streaming and deepseek" &
         wait
         for n in 1 16; do
             timeout 120 python3 tools/sweep_experts.py "$OUT/sweep$n.json" --formats nvfp4 \
                 --variants mma-g4-d4-p5-c-l,tma-g1-d2-w --layers $n > "$OUT/sweep$n.txt" 2>&1
         done
         if [ $SECONDS -lt 400 ]; then
             { python3 -m engine.synth glm-4.7-flash /tmp/glm &&
               timeout $((580 - SECONDS)) python3 -m engine.bench gpu-stream --model /tmp/glm \
                   --vram-gb 8 --ram-gb 32 --tokens 64 --prompt-len 512; } > "$OUT/glm_bench.txt" 2>&1
         fi ;;
    s22b) # s22's two unfinished graph tests beside a GLM-4.7-Flash profile: the op profile and
         # the all-resident decode of the synthetic arena (GPU times; the tests load the CPU)
         run oss tests/test_families_cuda.py -k "test_graph_replay_and_streaming and gpt_oss" &
         run dsv3 tests/test_families_cuda.py -k "test_graph_replay_and_streaming and deepseek" &
         { [ -d /tmp/glm ] || python3 -m engine.synth glm-4.7-flash /tmp/glm > /dev/null 2>&1
           timeout 200 python3 tools/op_profile.py /tmp/glm --vram-gb 40 --prompt-len 512 \
               > "$OUT/glm_prof.txt" 2>&1
           timeout 150 python3 -m engine.bench gpu-stream --model /tmp/glm --vram-gb 40 \
               --ram-gb 32 --tokens 64 --prompt-len 512 > "$OUT/glm_res.txt" 2>&1; } &
         wait ;;
    s22c) # the MLA decode kernels (staged attention, the T = 1 absorb kernels): their tests and
         # the MLA families' on cuda, beside the kernel sweep and GLM-4.7-Flash's decode with
         # gml.STAGED on and off (one process, all resident)
         run mla tests/test_mla_cuda.py &
         run fam tests/test_families_cuda.py -k "deepseek or lite" &
         { timeout 150 python3 tools/sweep_mla.py "$OUT/sweep_mla.json" > "$OUT/sweep_mla.txt" 2>&1
           [ -d /tmp/glm ] || python3 -m engine.synth glm-4.7-flash /tmp/glm > /dev/null 2>&1
           timeout $((LIMIT - SECONDS)) python3 tools/decode_ab.py /tmp/glm \
               --flag kernels_numba.gpu_mla.STAGED --vram-gb 40 --tokens 64 --prompt-len 512 \
               --rounds 2 --out "$OUT/ab.json" > "$OUT/ab.txt" 2>&1; } &
         wait ;;
    s22d) # s22c again on the cp.async staged attention, without the families' tests
         run mla tests/test_mla_cuda.py &
         { timeout 100 python3 tools/sweep_mla.py "$OUT/sweep_mla.json" > "$OUT/sweep_mla.txt" 2>&1
           [ -d /tmp/glm ] || python3 -m engine.synth glm-4.7-flash /tmp/glm > /dev/null 2>&1
           timeout $((LIMIT - SECONDS)) python3 tools/decode_ab.py /tmp/glm \
               --flag kernels_numba.gpu_mla.STAGED --vram-gb 40 --tokens 64 --prompt-len 512 \
               --rounds 2 --out "$OUT/ab.json" > "$OUT/ab.txt" 2>&1; } &
         wait ;;
    s23) # the lean staged MLA attention: its tests beside the gh x split grid (three shapes, two
         # positions), then GLM-4.7-Flash's decode with it on and off (all resident) at the
         # grid's best (gh, split) for glm-4.7-flash (summed over the positions); beside them the
         # MLA families on cuda (GLM-4.7-Flash's decode: q_a | kv_a fused, norms fused in)
         run mla tests/test_mla_cuda.py &
         run fam tests/test_families_cuda.py -k "lite or deepseek_v3" &
         { timeout 200 python3 tools/sweep_mla.py "$OUT/grid.json" --grid > "$OUT/grid.txt" 2>&1
           best=$(python3 -c "
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))['rows'] if r['variant'] == 'staged' and r['shape'] == 'glm-4.7-flash']
t = {}
for r in rows:
    t[r['gh'], r['split']] = t.get((r['gh'], r['split']), 0) + r['us']
print('--set kernels_numba.gpu_mla.STAGED_GH=%d --set kernels_numba.gpu_mla.STAGED_SPLIT=%d' % min(t, key=t.get))
" "$OUT/grid.json")
           echo "best: $best" >> "$OUT/grid.txt"
           [ -d /tmp/glm ] || python3 -m engine.synth glm-4.7-flash /tmp/glm > /dev/null 2>&1
           timeout $((LIMIT - SECONDS)) python3 tools/decode_ab.py /tmp/glm $best \
               --flag kernels_numba.gpu_mla.STAGED_ATT --vram-gb 40 --tokens 64 --prompt-len 512 \
               --rounds 2 --out "$OUT/ab.json" > "$OUT/ab.txt" 2>&1; } &
         wait ;;
    s23t) # s23 without the decode A/B (for a call with little device time left): the staged
         # attention's tests and the MLA families on cuda beside the grid
         run mla tests/test_mla_cuda.py &
         run fam tests/test_families_cuda.py -k "lite or deepseek_v3" &
         timeout 200 python3 tools/sweep_mla.py "$OUT/grid.json" --grid > "$OUT/grid.txt" 2>&1 &
         wait ;;
    bench) # engine.bench gpu-stream on the MLA presets at --vram-gb 8 (arenas from s21 if there)
         for m in glm:glm-4.7-flash dsl:deepseek-v2-lite; do
             d=/tmp/${m%%:*}
             [ -d $d ] || python3 -m engine.synth ${m#*:} $d > "$OUT/${m%%:*}_bench.log" 2>&1
             timeout 250 python3 -m engine.bench gpu-stream --model $d --vram-gb 8 --ram-gb 8 32 \
                 >> "$OUT/${m%%:*}_bench.log" 2>&1
             echo -e "\nexit $? after ${SECONDS}s" >> "$OUT/${m%%:*}_bench.log"
         done ;;
    s25) # the SMs' PCIe reads of the RAM cache (gm.expert_gather, blocks an expert swept) against
         # the copy engine at one Qwen3-30B-A3B layer's size; the engine's gather / streaming tests
         # beside the arena's writing; then that preset at --vram-gb 8 --ram-gb 32 (warm), uniform
         # and the model's own routing, the host copying the misses (gather 0) and the token
         # graph gathering them (gate and gather in one launch, MOE_STREAM_GATE_FOLD=1) at the
         # probe's best blocks an expert
         timeout 120 python3 tools/gather_probe.py --json "$OUT/probe.json" 2>&1 | grep -v -i warn > "$OUT/bench.txt"
         best=$(python3 -c "
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))['rows'] if 'gather' in r['what']]
print(re.search(r'(\d+) blocks', max(rows, key=lambda r: r['gbps'])['what']).group(1))
" "$OUT/probe.json" 2>/dev/null || echo 32)
         { [ -d /tmp/q30 ] || python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1 \
             >> "$OUT/bench.txt"; } &
         LIMIT=${TEST_S:-200} run engine tests/test_gpu_engine.py -k "gathered or streaming_under" &
         wait
         n=${RUNS:-4}   # the first RUNS of the four
         for v in "0 0 uniform" "1 $best uniform" "1 $best own" "0 0 own"; do
             [ $n -gt 0 ] || break
             set -- $v
             t=$(( (${END_S:-585} - SECONDS) / n )); n=$((n - 1))
             r=""; [ $3 = uniform ] && r="--route uniform"
             echo "== gather $1 blocks $2 routing $3 at ${SECONDS}s" >> "$OUT/bench.txt"
             MOE_STREAM_DEVICE_GATHER=$1 MOE_STREAM_GATHER_BLOCKS=$2 MOE_STREAM_GATE_FOLD=1 \
                 timeout $t python3 -m engine.bench gpu-stream --model /tmp/q30 --vram-gb 8 \
                 --ram-gb 32 --warm-ram $r --tokens 64 --prompt-len 512 --out "$OUT/$3_g$1.json" 2>&1 | grep -v -i warn | tail -5 \
                 >> "$OUT/bench.txt"
         done ;;
    dsa) # DeepSeek-V3.2 / GLM-5 on cuda with the indexer on the device (engine/gpu_dsa.py; not
         # yet run): the DSA kernels, parity past index_topk and graph replay, beside the MLA
         # kernels' tests (their attention takes the picks now)
         run dsa tests/test_dsa_cuda.py &
         run mla tests/test_mla_cuda.py & wait ;;
    s27) # the never-run families on cuda (2026-12-07): Step-3.5 (tests/test_step3p5.py, and the
         # limited SwiGLU experts' kernels), Cohere's MoE (tests/test_cohere2_moe.py, the
         # LayerNorm kernel with the dense kernels), MiniMax-M3 (tests/test_minimax_m3.py), Llama 4
         # (tests/test_llama4.py, the input-scaled experts' kernels), MiMo-V2-Flash, Hunyuan-A13B, Solar Open, AFMoE,
         # DeepSeek-V3.2 / GLM-5 and EXAONE-MoE's parity
         # (three processes; a family's tests take about 150-250 s with their compiles)
         { run step tests/test_step3p5.py; run cohere tests/test_cohere2_moe.py; run afmoe tests/test_afmoe.py; } &
         { run m3 tests/test_minimax_m3.py; run llama4 tests/test_llama4.py; run mimo tests/test_mimo_v2_flash.py
           run vl tests/test_minicpm5.py tests/test_glm4v.py tests/test_qwen3_omni.py tests/test_ernie_vl.py; } &
         { run kern tests/test_cuda_kernels.py -k "limited or scaled or dense or norm"
           run fam tests/test_families_cuda.py -k "deepseek_v32 or glm_moe_dsa or exaone or hunyuan or solar"; } &
         wait ;;
    s27b) # what s27 left unfinished on 2026-12-07 (its first run passed Cohere, Llama 4, MiMo and
         # AFMoE's parity): Step-3.5, AFMoE's graph tests, MiniMax-M3, the wrapper families and
         # MiniCPM5, the limited SwiGLU's bf16 experts, V3.2 / GLM-5 / K-EXAONE / Hunyuan / Solar
         { run step tests/test_step3p5.py; run afmoe tests/test_afmoe.py -k "graph or stream"; } &
         { run m3 tests/test_minimax_m3.py
           run vl tests/test_minicpm5.py tests/test_glm4v.py tests/test_qwen3_omni.py tests/test_ernie_vl.py; } &
         { run kern tests/test_cuda_kernels.py -k "limited and bf16"
           run fam tests/test_families_cuda.py -k "deepseek_v32 or glm_moe_dsa or exaone or hunyuan or solar"; } &
         wait ;;
    s28) # this checkout's new cuda paths and the two families the machine's transformers 5.17 cannot
         # build (2026-12-07, not yet run), all against the carried transformers 5.25 (.whl/tf,
         # tools/fetch_wheels.sh): MiniMax-M3 and MiniCPM5-MoE beside FlexOlmo and Phi-3.5-MoE (their
         # parity, graph replay and streaming), the sparsemixer router kernel and Llama 4 (its
         # chunked attention now on cuda), then the attention kernels' tests
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_tf \
             .whl/tf/*.whl > "$OUT/tf.txt" 2>&1 || exit 1
         export PYTHONPATH=/tmp/site_tf:$PYTHONPATH
         { run m3 tests/test_minimax_m3.py; run cpm tests/test_minicpm5.py; } &
         { run phi tests/test_phimoe.py; run kern tests/test_cuda_kernels.py -k sparsemixer; } &
         { run flex tests/test_flex_olmo.py; run l4 tests/test_llama4.py; } &
         wait
         # the chunked attention's kernels (window -C) at real shapes with the rest of the file's
         LIMIT=$((590 - SECONDS)) run att tests/test_attention_decode.py ;;
    s30) # the served layer's table changes as one copy (MOE_STREAM_TABLE_BATCH=1, 2026-12-07, not
         # yet run): the engine's streaming tests with it, beside the synthetic arena's writing;
         # then Qwen3-30B-A3B at --vram-gb 8 --ram-gb 32 (warm), uniform routing, without and with
         # it, one process each
         { [ -d /tmp/q30 ] || python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1 \
             > "$OUT/bench.txt"; } &
         MOE_STREAM_TABLE_BATCH=1 LIMIT=${TEST_S:-200} run engine tests/test_gpu_engine.py \
             -k "streaming or stream or gathered" &
         wait
         # the SM clock beside each run (sampled every 100 ms): the streamed token's "compute" is
         # 3.6x the all-resident token's, and an SM clock that falls while the gates wait would
         # explain it; the last run, all resident, for the clock it keeps
         for b in 0 1 0 1 r; do
             [ $SECONDS -lt 500 ] || break
             echo "== table batch $b at ${SECONDS}s" >> "$OUT/bench.txt"
             nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw \
                 --format=csv,noheader -lms 100 > "$OUT/clocks_t$b.csv" 2>&1 & smi=$!
             if [ $b = r ]; then vram="--vram-gb 40"; else vram="--vram-gb 8 --ram-gb 32 --warm-ram"; fi
             MOE_STREAM_TABLE_BATCH=${b/r/0} timeout $((585 - SECONDS)) python3 -m engine.bench gpu-stream \
                 --model /tmp/q30 $vram --route uniform --tokens 64 \
                 --prompt-len 128 --out "$OUT/uniform_t$b.json" 2>&1 | grep -v -i warn | tail -5 >> "$OUT/bench.txt"
             kill $smi 2>/dev/null
         done ;;
    s31) # where the streamed token's time goes (2026-12-07, not yet run): an Nsight Systems
         # timeline of Qwen3-30B-A3B at --vram-gb 8 --ram-gb 32 (warm), uniform routing, 24 tokens:
         # the copy stream's copies and memsets, the gates' stops and the host's driver calls.
         # The bench's "compute" (13.6 ms a token on the H100, twenty-ninth session) is 3.6x the
         # all-resident token's 3.8 ms: the timeline says which of the stops' latencies it is
         NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys 2>/dev/null | tail -1)
         echo "nsys: $NSYS" > "$OUT/bench.txt"
         [ -n "$NSYS" ] || exit 1
         [ -d /tmp/q30 ] || python3 -m engine.synth qwen3-30b-a3b /tmp/q30 --force 2>&1 | tail -1 >> "$OUT/bench.txt"
         for b in 0 1; do
             MOE_STREAM_TABLE_BATCH=$b timeout 200 "$NSYS" profile -t cuda,osrt,nvtx -s none \
                 -o "$OUT/stream_t$b" -f true python3 -m engine.bench gpu-stream --model /tmp/q30 \
                 --vram-gb 8 --ram-gb 32 --warm-ram --route uniform --tokens 24 --prompt-len 32 \
                 2>&1 | grep -v -i warn | tail -3 >> "$OUT/bench.txt"
             "$NSYS" stats -r cuda_api_sum,cuda_gpu_mem_time_sum,cuda_gpu_kern_sum -f csv \
                 -o "$OUT/stream_t$b" "$OUT/stream_t$b.nsys-rep" > /dev/null 2>&1
             "$NSYS" stats -r cuda_gpu_trace -f csv -o "$OUT/trace_t$b" "$OUT/stream_t$b.nsys-rep" \
                 > /dev/null 2>&1 && gzip -f "$OUT"/trace_t$b*.csv
             rm -f "$OUT/stream_t$b.sqlite"
         done ;;
    s32) # DBRX and the Granite MoE families on cuda (2026-12-07, not yet run: parity, graph replay,
         # streaming) beside the router kernels' tests (router_topk's new norm 2)
         { run dbrx tests/test_dbrx.py; run kern tests/test_cuda_kernels.py -k router; } &
         run granite tests/test_granitemoe.py & wait ;;
    s33) # the thirty-first session's families on cuda (2026-12-07, not yet run): Hy3-preview
         # (the generic decoder) and Mistral Small 4 (MLA, grouped softmax routing, the query
         # scale by position) parity, graph replay and streaming, beside the MLA kernels' tests
         # (router_sigmoid_topk's pair_groups, the query temperature's shift) and the streamed
         # engine's tests on the host issue path's kept addresses (1f4ceb4)
         { run hy3 tests/test_hy_v3.py; run mistral4 tests/test_mistral4.py; } &
         { run mla tests/test_mla_cuda.py; run engine tests/test_gpu_engine.py -k "stream or gather"; } &
         wait ;;
    s34) # Mamba-2 on cuda (2026-12-07, not yet run): Granite 4.0 hybrid and Nemotron-H parity with
         # transformers, graph replay (the state saved and put back around capture), prefill past
         # 16 tokens (the GEMM and tiled grouped kernels), streaming = all resident, the kernels at
         # real shapes (the softplus threshold's dt = 100 case is exact only on a GPU), beside the
         # Qwen3-Next hybrid's tests (RecurrentDecoder was split out of it)
         run mamba tests/test_gpu_mamba.py & run hybrid tests/test_gpu_hybrid.py & wait ;;
    newbench) # the new families' streaming decode at --vram-gb 8 --ram-gb 32 on synthetic arenas cut
         # to fit the disk (Hunyuan-A13B 16 of 32 layers, Llama-4-Scout 12 of 48, MiMo-V2-Flash 8 of 48),
         # one after another in what the call allows (2026-12-07, not yet run)
         for m in hunyuan-a13b:16 llama-4-scout:12 mimo-v2-flash:8; do
             p=${m%%:*}; d=/tmp/$p
             [ $SECONDS -lt 420 ] || break
             { [ -d $d ] || python3 -m engine.synth $p $d --layers ${m#*:}; } > "$OUT/$p.txt" 2>&1 &&
                 timeout $((580 - SECONDS)) python3 -m engine.bench gpu-stream --model $d --vram-gb 8 \
                     --ram-gb 32 --tokens 64 --prompt-len 512 >> "$OUT/$p.txt" 2>&1
             rm -rf $d
         done ;;
    s25p) # s25's probe and the engine's gather tests alone (little device time left)
         timeout 90 python3 tools/gather_probe.py --json "$OUT/probe.json" 2>&1 | grep -v -i warn \
             > "$OUT/bench.txt"
         LIMIT=${TEST_S:-150} run engine tests/test_gpu_engine.py -k "gathered or streaming_under" ;;
    *) echo "usage: bash tools/gpu_session.sh a|b|c|e|f|ef|oss|mla|new|s21|s21b|s21c|s22|s22b|s22c|s22d|s23|s23t|bench|s25|s25p|dsa|s27|s27b|s28|s30|s31|s32|newbench" >&2; exit 2 ;;
esac
rc=0
for f in "$OUT"/*.log; do
    echo "== $(basename "$f")"
    grep -E "passed|failed|FAILED|^E  |^exit " "$f" | cut -c1-250 | tail -12
    grep -q "^exit 0 " "$f" || rc=1
done
exit $rc
