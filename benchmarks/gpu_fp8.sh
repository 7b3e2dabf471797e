#!/usr/bin/env bash
# fp8-e4m3 chunk storage against bf16 on the H200: TTFT through engine.answer (qcfuse and naive
# at 0.15 and 0.3, full beside them) with the store writing chunks in each dtype; the host and
# disk tiers are where fp8's half bytes should show (gpu tier: both resident).
#     bash benchmarks/gpu_fp8.sh          (writes under $OUT; about 6 minutes)
set -uo pipefail
export OUT=${OUT:-$PWD/gpu-out} PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
STORE=/tmp/qcfuse-fp8-store
BENCH="python3 -m qcfuse_core.cli bench ttft --shape llama-3.1-8b --device cuda --dtype bf16 --query-tokens 32"
for dt in bf16 fp8; do
  timeout 250 $BENCH --context-sizes 10x1024 32x1024 --tier host disk --methods full naive qcfuse --ratios 0.15 0.3 \
      --storage-dtype $dt --runs 10 --warmup 2 --store "$STORE-$dt" \
      --json "$OUT/ttft_$dt.json" --markdown "$OUT/ttft_$dt.md" 2>&1 | tail -20
  rm -rf "$STORE-$dt"
done
