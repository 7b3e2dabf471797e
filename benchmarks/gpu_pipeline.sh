#!/usr/bin/env bash
# The request pipeline on the H200: GPU tests, then `qcfuse bench ttft` through engine.answer.
#     STAGE=smoke|host|full|tiers bash benchmarks/gpu_pipeline.sh     (writes under $OUT)
# smoke, host and full start with the GPU tests (incl. the compiled kernels against their
# references) and the CUDA prefetch check. smoke: one 10x1024 host-tier table + a profile of
# qcfuse's request (about 4 minutes). host: the 10x1024 host-tier table and a cProfile of
# lookup + select's host side (about 5 minutes). full: every size on the host tier and the
# batched ingestion of 64 x 1024-token chunks (about 8 minutes). tiers: no tests; 10x1024 on
# the gpu and disk tiers, ingestion into /dev/shm, and the torch.profiler breakdown of
# qcfuse's request (about 6 minutes). `full` then `tiers` (two calls: one call may run 10
# minutes) reproduce every H200 table of docs/benchmarks.md.
set -uo pipefail
export OUT=${OUT:-$PWD/gpu-out} PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
STAGE=${STAGE:-smoke}
STORE=/tmp/qcfuse-ttft-store  # GBs of chunk data: outside $OUT, which comes back
BENCH="python3 -m qcfuse_core.cli bench ttft --shape llama-3.1-8b --device cuda --dtype bf16 --query-tokens 32"
METHODS="--methods full naive qcfuse cacheblend epic --ratios 0.15 0.3"
tests() {
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_kernels_pointwise.py tests/test_gpu_fusion.py tests/test_gpu_probe_graph.py \
      tests/test_store_gpu.py tests/test_engine_device.py tests/test_request_pipeline.py tests/test_ingest.py tests/test_prefetch.py \
      2>&1 | tee "$OUT/tests.log" | grep --line-buffered -E "passed|failed|error|Error" | tail -20
  timeout 60 python3 benchmarks/run_ttft.py check-cuda 2>&1 | tee "$OUT/check_cuda.log" | tail -3
}
[ "$STAGE" = tiers ] || tests
if [ "$STAGE" = host ]; then
  timeout 150 $BENCH --context-sizes 10x1024 --tier host $METHODS --runs 10 --warmup 2 \
      --store "$STORE" --json "$OUT/ttft_host10.json" --markdown "$OUT/ttft_host10.md" 2>&1 | tail -15
  rm -rf "$STORE"
  timeout 150 python3 benchmarks/profile_gpu.py host --out "$OUT" --methods qcfuse@0.15 --top 45 \
      > "$OUT/profile_host.txt" 2>&1; grep -A60 "====" "$OUT/profile_host.txt" | cut -c1-150 | head -70
elif [ "$STAGE" = smoke ]; then
  timeout 150 $BENCH --context-sizes 10x1024 --tier host $METHODS --runs 10 --warmup 2 \
      --store "$STORE" --json "$OUT/ttft_smoke.json" --markdown "$OUT/ttft_smoke.md" 2>&1 | tail -15
  rm -rf "$STORE"
  timeout 120 python3 benchmarks/profile_answer.py --size 10x1024 --method qcfuse --ratio 0.15 --top 25 \
      > "$OUT/profile_qcfuse.txt" 2>&1; head -12 "$OUT/profile_qcfuse.txt"
elif [ "$STAGE" = full ]; then
  timeout 330 $BENCH --context-sizes 4x1024 10x1024 20x1024 32x1024 --tier host $METHODS --runs 10 --warmup 2 \
      --ingest-chunks 64 --store "$STORE" --json "$OUT/ttft_host.json" --markdown "$OUT/ttft_host.md" 2>&1 | tail -30
  rm -rf "$STORE"
elif [ "$STAGE" = tiers ]; then
  timeout 200 $BENCH --context-sizes 10x1024 --tier gpu disk $METHODS --runs 10 --warmup 2 \
      --store "$STORE" --json "$OUT/ttft_tiers.json" --markdown "$OUT/ttft_tiers.md" 2>&1 | tail -20
  rm -rf "$STORE"
  # ingestion again with the store in memory (/dev/shm): what the disk costs
  timeout 100 $BENCH --context-sizes 10x1024 --tier host --methods full --runs 3 --warmup 1 --ingest-chunks 64 \
      --store /dev/shm/qcfuse-ingest --json "$OUT/ingest_shm.json" 2>&1 | tail -2
  rm -rf /dev/shm/qcfuse-ingest
  timeout 120 python3 benchmarks/profile_gpu.py stages --out "$OUT" --methods qcfuse@0.15 qcfuse@0.3 epic@0.15 --top 30 \
      > "$OUT/profile_stages.txt" 2>&1; grep -A10 "====" "$OUT/profile_stages.txt" | head -40
else
  echo "unknown STAGE=$STAGE (smoke | host | full | tiers)" >&2; exit 2
fi
