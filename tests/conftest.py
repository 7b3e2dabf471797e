# Triton decides at import time whether kernels are compiled or interpreted; CPU tests need
# the interpreter. setdefault: `TRITON_INTERPRET=0 pytest ...` on a GPU host runs compiled kernels.
import os; os.environ.setdefault("TRITON_INTERPRET", "1")  # noqa: E702

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct in fp32 (converted once into the cache dir)."""
    from qcfuse_core.model import load_model

    return load_model(dtype="fp32")


@pytest.fixture(scope="session")
def smol_engine(smol):
    from qcfuse_core.engine import QCFuseEngine

    return QCFuseEngine(smol)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _kernel_backend(request):
    """Tests on the real embedded model use the PyTorch reference kernels (the interpreter is
    far too slow at real shapes); tiny-model tests keep the detected backend (the Triton
    interpreter under TRITON_INTERPRET=1), so the engine is exercised through the kernels too."""
    import qcfuse_kernels as K

    real = {"smol", "smol_engine"} & set(request.fixturenames)
    if real:
        K.set_backend("torch")
    yield
    if real:
        K.set_backend(None)
