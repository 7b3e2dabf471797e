#!/usr/bin/env bash
# TTFT on the other named shapes (host tier): qwen3-8b (q/k RMSNorm, 36 layers, probe to layer
# 21) and mistral-7b, same workload as the llama-3.1-8b table.
#     bash benchmarks/gpu_other_shapes.sh      # writes under $OUT (default ./shapes-out)
set -uo pipefail
OUT=${OUT:-$PWD/shapes-out}
source "$(dirname "$0")/gpu_env.sh"
for shape in qwen3-8b mistral-7b; do
  timeout 280 python3 benchmarks/run_ttft.py ttft --shape $shape --device cuda --dtype bf16 \
      --chunks 10 --chunk-tokens 1024 --query-tokens 32 --tier host \
      --methods full qcfuse cacheblend naive epic --ratios 0.15 0.3 --runs 10 --warmup 3 \
      --store /tmp/qcfuse-ttft-$shape --json "$OUT/ttft_$shape.json" --markdown "$OUT/ttft_$shape.md" 2>&1 \
      | grep -v -i warn | grep -E "^\||critical|rates" | tail -n 14
  rm -rf /tmp/qcfuse-ttft-$shape
done
