#!/usr/bin/env bash
# Where fused prefill's time goes on the GPU machine: attention kernels side by side, then the
# per-kernel profile of qcfuse / epic / naive requests (bench ttft's workload).
#     bash benchmarks/gpu_where_time.sh        # writes under $OUT (default ./where-out)
set -uo pipefail
OUT=${OUT:-$PWD/where-out}
source "$(dirname "$0")/gpu_env.sh"
for r in 1568 3104; do
  timeout 150 python3 benchmarks/attn_micro.py --rows $r --json "$OUT/attn_$r.json" 2>&1 | grep -v -i warn | grep -v '^ ' | tail -n 8
done
timeout 200 python3 benchmarks/profile_select.py --out "$OUT/prof" --methods qcfuse epic naive 2>&1 | grep -v -i warn | tail -n 30
rm -f "$OUT/prof/trace.json"
head -n 45 "$OUT/prof/profile_cuda.txt" | cut -c1-60,100-200
