#!/usr/bin/env bash
# Device-time profiles of a request and of ingestion on the H200 (writes under $OUT):
#     OUT=... bash benchmarks/gpu_profile.sh
set -uo pipefail
export OUT=${OUT:-$PWD/gpu-out} PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
timeout 200 python3 benchmarks/profile_gpu.py stages --out "$OUT" --methods qcfuse@0.15 epic@0.15 naive@0 2>&1 \
    | tee "$OUT/stages.txt" | grep --line-buffered -E "====|step:" 
timeout 200 python3 benchmarks/profile_gpu.py ingest --out "$OUT" 2>&1 | tee "$OUT/ingest.txt" | tail -45
