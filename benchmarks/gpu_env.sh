# Sourced by the benchmarks/gpu_*.sh scripts on the GPU machine (set OUT first): makes $OUT,
# puts `kernels/` on the path as `qcfuse_kernels` (the tree is not pip-installed there),
# compiled Triton, a scratch cache dir, and records date, GPU and versions in $OUT/env.txt.
mkdir -p "$OUT"
SHIM=$(mktemp -d); ln -s "$PWD/kernels" "$SHIM/qcfuse_kernels"
export PYTHONPATH="$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 QCFUSE_CACHE_DIR=/tmp/qcfuse-cache
{ date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee "$OUT/env.txt"
