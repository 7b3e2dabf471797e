#!/usr/bin/env bash
# Probe CUDA graphs on the GPU machine: tests, the selection profile, then the TTFT table.
#     bash benchmarks/gpu_probe_graph.sh        # writes under $OUT (default ./probe-out)
set -uo pipefail
OUT=${OUT:-$PWD/probe-out}
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_probe_graph.py tests/test_probe.py tests/test_engine_device.py \
    tests/test_gpu_fusion.py tests/test_planner.py > "$OUT/tests.log" 2>&1; echo "pytest rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|error|rc=" "$OUT/tests.log" | tail -n 3
timeout 60 python3 benchmarks/run_ttft.py check-cuda 2>&1 | tail -n 5 | tee "$OUT/check_cuda.log"
timeout 150 python3 benchmarks/profile_select.py --out "$OUT/prof" --methods qcfuse epic cacheblend 2>&1 | grep -v -i warn | tail -n 40
rm -f "$OUT/prof/trace.json"
# A/B: the same profile with the probe run eagerly
QCFUSE_PROBE_GRAPHS=0 timeout 120 python3 benchmarks/profile_select.py --out "$OUT/prof_eager" --methods qcfuse 2>&1 | grep -A6 '"qcfuse"'
rm -f "$OUT/prof_eager/trace.json"
timeout 330 python3 benchmarks/run_ttft.py ttft --shape llama-3.1-8b --device cuda --dtype bf16 \
    --chunks 10 --chunk-tokens 1024 --query-tokens 32 --tier host disk \
    --methods full qcfuse cacheblend naive epic --ratios 0.15 0.3 --runs 10 --warmup 3 \
    --store /tmp/qcfuse-ttft-store --json "$OUT/ttft_h200.json" --markdown "$OUT/ttft_h200.md" 2>&1 | grep -v -i warn | tail -n 25
rm -rf /tmp/qcfuse-ttft-store
