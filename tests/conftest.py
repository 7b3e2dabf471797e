# Triton decides at import time whether kernels are compiled or interpreted; CPU tests need
# the interpreter. setdefault: `TRITON_INTERPRET=0 pytest ...` on a GPU host runs compiled kernels.
import os; os.environ.setdefault("TRITON_INTERPRET", "1")  # noqa: E702

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--standard-integration", action="store_true",
                     help="run langchain-tests' chat-model integration suite on the embedded model "
                          "(tests/test_langchain_standard_integration.py; over 15 minutes on 2 CPU cores)")


def pytest_collection_modifyitems(config, items):
    from tests.tiers import check_tiers

    check_tiers(items)  # a test that starts a slow-tier resource is marked slow (tests/tiers.py)
    if config.getoption("--standard-integration"):
        return
    skip = pytest.mark.skip(reason="langchain-tests' integration suite runs with --standard-integration "
                                   "(over 15 minutes on 2 CPU cores)")
    for item in items:
        if item.get_closest_marker("standard_integration") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct in fp32 (converted once into the cache dir)."""
    from qcfuse_core.model.adapter import load_model

    return load_model(dtype="fp32")


@pytest.fixture(scope="session")
def smol_engine(smol):
    from qcfuse_core.engine.api import QCFuseEngine

    return QCFuseEngine(smol)


@pytest.fixture(scope="module", autouse=True)
def _fidelity_ledgers_per_module(tmp_path_factory):
    """The engine's audit (engine/audit.py) keeps its ledgers in a fresh temporary folder for
    each test module, never the user's cache dir (subprocesses inherit it): what one module's
    engines audited (and the guard calibrated itself from) never reaches another's. A
    module's shared engines resolve their folder here, before any test of it runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QCFUSE_FIDELITY_DIR", str(tmp_path_factory.mktemp("fidelity")))
        yield


@pytest.fixture(autouse=True)
def _fidelity_ledgers_per_test(tmp_path_factory, monkeypatch):
    """... and for each test: an engine a test opens starts with no audit evidence, whatever
    the tests before it answered."""
    monkeypatch.setenv("QCFUSE_FIDELITY_DIR", str(tmp_path_factory.mktemp("fidelity")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _reference_kernels_by_default():
    """The PyTorch reference kernels for everything, including module- and session-scoped
    fixtures that run a real model (they are set up before any function-scoped fixture)."""
    import qcfuse_kernels as K

    K.set_backend("torch")
    yield
    K.set_backend(None)


@pytest.fixture(autouse=True)
def _kernel_backend(request):
    """Tests marked `kernels` run with the detected kernel backend (Triton's interpreter on
    CPU under TRITON_INTERPRET=1, compiled Triton on a GPU), except those on the real
    embedded model, where the interpreter is far too slow. Every other test uses the PyTorch
    references. Tests may still override with set_backend inside."""
    import qcfuse_kernels as K

    if request.node.get_closest_marker("kernels") is not None and not (
            {"smol", "smol_engine"} & set(request.fixturenames)):
        K.set_backend(None)
    yield
    K.set_backend("torch")
