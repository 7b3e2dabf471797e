#!/usr/bin/env bash
# One H200 call: correctness of the kernels and the CUDA fused path, plus kernel and store
# benchmarks. Usage (on the device machine, repo root): bash benchmarks/gpu_check.sh
# Writes logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/qcfuse-out}; mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python -c "import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"; } > "$OUT/env.txt" 2>&1
# No registry there, and an editable install does not map kernels/ -> qcfuse_kernels on every
# setuptools: run from the tree with a one-link shim instead.
SHIM=$(mktemp -d); ln -s "$PWD/kernels" "$SHIM/qcfuse_kernels"; export PYTHONPATH="$SHIM:$PWD"
python -c "import qcfuse_kernels, qcfuse_core; print('backend', qcfuse_kernels.backend())" >> "$OUT/env.txt" 2>&1
timeout 240 python -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_gpu_fusion.py \
    tests/test_fusion_exact.py tests/test_store_gpu.py -k "not embedded" > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
${SKIP_BENCH:+true} timeout 150 python benchmarks/bench_kernels.py --json "$OUT/kernels_bf16.json" > "$OUT/bench_kernels_bf16.txt" 2>&1
[ -n "${FP16:-}" ] && timeout 100 python benchmarks/bench_kernels.py --dtype float16 --json "$OUT/kernels_fp16.json" > "$OUT/bench_kernels_fp16.txt" 2>&1
${SKIP_BENCH:+true} timeout 90 python benchmarks/bench_store.py --json "$OUT/store.json" > "$OUT/bench_store.txt" 2>&1
tail -15 "$OUT"/pytest_gpu.txt; tail -25 "$OUT"/bench_kernels_bf16.txt 2>/dev/null
