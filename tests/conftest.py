# Triton decides at import time whether kernels are compiled or interpreted; CPU tests need
# the interpreter. setdefault: `TRITON_INTERPRET=0 pytest ...` on a GPU host runs compiled kernels.
import os; os.environ.setdefault("TRITON_INTERPRET", "1")  # noqa: E702
