#!/usr/bin/env bash
# One device call for selection options: the engine end to end on CUDA (streamed == in memory,
# incl. deviation_pool) and the selector tests, then TTFT on the issue-6 workload with qcfuse
# plain and with each variant side by side (host tier). Variants: space-separated
# LABEL:KEY=VALUE (default: deviation_pool=2).
#     OUT=... [VARIANTS="qcfuse-pos05:position_prior=0.5 ..."] bash benchmarks/gpu_deviation.sh [RUNS]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
RUNS=${1:-10}
VARIANTS=${VARIANTS:-qcfuse-dev2:deviation_pool=2}
VARIANT_ARGS=(); for v in $VARIANTS; do VARIANT_ARGS+=(--variant "$v"); done
source "$(dirname "$0")/gpu_env.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_engine_device.py tests/test_selectors.py \
    tests/test_gpu_fusion.py > "$OUT/tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|error|rc=" "$OUT/tests.log" | tail -n 3
timeout 400 python3 benchmarks/run_ttft.py ttft --shape llama-3.1-8b --device cuda --dtype bf16 \
    --chunks 10 --chunk-tokens 1024 --query-tokens 32 --tier host \
    --methods full qcfuse cacheblend "${VARIANT_ARGS[@]}" --ratios 0.15 0.3 \
    --runs "$RUNS" --warmup 3 --store /tmp/qcfuse-ttft-store --json "$OUT/ttft_h200.json" \
    --markdown "$OUT/ttft_h200.md" 2>&1 | grep -v -i warn | tail -n 12
rm -rf /tmp/qcfuse-ttft-store
