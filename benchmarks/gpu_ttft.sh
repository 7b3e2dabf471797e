#!/usr/bin/env bash
# TTFT on the H200 (issue 6 targets). Run from the repository root on a bare machine:
#     bash benchmarks/gpu_ttft.sh            # writes under $OUT (default ./ttft-out)
# Needs only the image's python3 (torch, triton, transformers, safetensors, xxhash); nothing
# is installed. Budget: at most 7.5 minutes (check <= 60 s, bench <= 390 s; rows are written
# to the JSON after each tier, so a timeout keeps the finished tiers).
set -uo pipefail
OUT=${OUT:-$PWD/ttft-out}
mkdir -p "$OUT"
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export QCFUSE_CACHE_DIR=/tmp/qcfuse-cache
STORE=/tmp/qcfuse-ttft-store  # GBs of chunk data: outside $OUT, which comes back
{ date -u; nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv;
  $PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)';
  df -h "$OUT" | tail -1; } 2>&1 | tee "$OUT/env.txt"

# 1. correctness on CUDA: prefetcher == in-memory default (gpu/host/disk tiers), fused logits equal
timeout 60 $PY benchmarks/run_ttft.py check-cuda 2>&1 | tee "$OUT/check_cuda.log"

# 2. the targets: llama-3.1-8b shape, 10 x 1024-token chunks + 32-token question, host and disk
#    tiers (gpu tier last, for context); methods full / qcfuse (or epic) / cacheblend / naive
QC=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import run_ttft; run_ttft.ensure_importable(); from qcfuse_core.selectors import SELECTORS; print('qcfuse' if 'qcfuse' in SELECTORS else 'epic')" 2>/dev/null || echo epic)
echo "query-aware method: $QC" | tee -a "$OUT/env.txt"
timeout 390 $PY benchmarks/run_ttft.py ttft --shape llama-3.1-8b --device cuda --dtype bf16 \
    --chunks 10 --chunk-tokens 1024 --query-tokens 32 --tier host disk gpu \
    --methods full "$QC" cacheblend naive --ratios 0.15 0.3 --runs 10 --warmup 2 \
    --store "$STORE" --json "$OUT/ttft_h200.json" --markdown "$OUT/ttft_h200.md" 2>&1 | tee "$OUT/ttft_h200.log"
rc=${PIPESTATUS[0]}
cp "$STORE"/rates-*.json "$OUT"/ 2>/dev/null; rm -rf "$STORE"
[ -f "$OUT/ttft_h200.md" ] || $PY -c "import json, sys; sys.path.insert(0, 'benchmarks'); import run_ttft; run_ttft.ensure_importable(); from qcfuse_core.bench_ttft import markdown; print(markdown(json.load(open('$OUT/ttft_h200.json'))['rows']))" > "$OUT/ttft_h200.md" 2>/dev/null
echo "exit $rc"; cat "$OUT/ttft_h200.md" 2>/dev/null
exit $rc
