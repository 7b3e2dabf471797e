#!/usr/bin/env bash
# One device call for a change to the GPU path: GPU tests, the CUDA check, the selection
# profile, then the TTFT table (host and disk tiers, bench ttft's issue-6 workload).
#     bash benchmarks/gpu_session.sh [RUNS] [TIERS...]   # writes under $OUT (default ./gpu-out)
# ALL_GPU_TESTS=1 runs every file of the suite that has GPU tests (the machine has no
# llama-index / langchain / chroma, so the integration files are not collected).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
RUNS=${1:-10}
shift || true
TIERS=${*:-host disk}
source "$(dirname "$0")/gpu_env.sh"
if [ -n "${ALL_GPU_TESTS:-}" ]; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider -rs -m "gpu or kernels" tests/test_kernels.py tests/test_kernels_pointwise.py \
      tests/test_gpu_fusion.py tests/test_gpu_probe_graph.py tests/test_store_gpu.py tests/test_store_processes.py tests/test_cli.py \
      > "$OUT/tests_gpu_all.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/tests_gpu_all.log"; grep -E "passed|failed|error|rc=" "$OUT/tests_gpu_all.log" | tail -n 3
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_engine_device.py tests/test_prefetch.py tests/test_probe.py \
      tests/test_planner.py > "$OUT/tests.log" 2>&1
else
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m "gpu or kernels" tests/test_kernels.py tests/test_kernels_pointwise.py \
      > "$OUT/tests_kernels.log" 2>&1; echo "pytest rc=$?" >> "$OUT/tests_kernels.log"
  grep -E "passed|failed|error|rc=" "$OUT/tests_kernels.log" | tail -n 3
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_probe_graph.py tests/test_probe.py tests/test_engine_device.py \
      tests/test_gpu_fusion.py tests/test_planner.py tests/test_prefetch.py > "$OUT/tests.log" 2>&1
fi
echo "pytest rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|error|rc=" "$OUT/tests.log" | tail -n 3
timeout 60 python3 benchmarks/run_ttft.py check-cuda 2>&1 | tail -n 5 | tee "$OUT/check_cuda.log"
timeout 150 python3 benchmarks/profile_select.py --out "$OUT/prof" --methods qcfuse epic naive 2>&1 | grep -v -i warn | grep -A 30 '"qcfuse"' | head -n 30
rm -f "$OUT/prof/trace.json"
timeout 330 python3 benchmarks/run_ttft.py ttft --shape llama-3.1-8b --device cuda --dtype bf16 \
    --chunks 10 --chunk-tokens 1024 --query-tokens 32 --tier $TIERS \
    --methods full qcfuse cacheblend naive epic --ratios 0.15 0.3 --runs "$RUNS" --warmup 3 \
    --store /tmp/qcfuse-ttft-store --json "$OUT/ttft_h200.json" --markdown "$OUT/ttft_h200.md" 2>&1 | grep -v -i warn | tail -n 30
rm -rf /tmp/qcfuse-ttft-store
