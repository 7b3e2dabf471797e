"""The fidelity target (issue 65) through the integrations: a component that names no ratio
leaves it to the engine, so an engine with `EngineConfig(fidelity=...)` chooses the
configuration (here, with no audit evidence yet: the conservative one, and it says so); a
component that names a ratio keeps it, and the answer says the ratio overrode the target."""

from __future__ import annotations

import pytest

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.audit import CONSERVATIVE_RATIO, AuditConfig
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore
from qcfuse_integrations.base import GenerationOptions

DOC = "The Orlen Observatory sits on Mount Tavel. Its telescope was installed in 1998 by Paul Renick. " * 2
PROMPT = f"{DOC}\n\nWho installed the telescope?"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = QCFuseEngine(
        tiny_model("llama", tokenizer=True),
        store=MemoryStore(),
        config=EngineConfig(fidelity=0.9, audit=AuditConfig(directory=str(tmp_path_factory.mktemp("fidelity")))),
    )
    eng.build_chunks([DOC])
    yield eng
    eng.close()


def _check(stats: dict, ratio: float | None) -> None:
    assert stats["chunks"] == 1 and stats["cache_hits"] == 1
    fid = stats["fidelity"]
    assert fid["target"] == 0.9
    if ratio is None:  # the engine's choice: conservative until the audit has evidence
        assert stats["requested_ratio"] == CONSERVATIVE_RATIO and fid["status"] == "conservative"
        assert "not enough evidence" in fid["reason"]
    else:
        assert stats["requested_ratio"] == ratio and fid["status"] == "fixed"
        assert "overrides the fidelity target" in fid["reason"]


def test_options_leave_the_ratio_to_the_engine_unless_named():
    assert GenerationOptions.resolve({}, {}).ratio is None
    assert GenerationOptions.resolve({"ratio": 0.3}, {}).ratio == 0.3
    assert GenerationOptions.resolve({"ratio": None}, {"ratio": 0.5}).ratio == 0.5
    with pytest.raises(ValueError, match="ratio must be in"):
        GenerationOptions.resolve({}, {"ratio": 1.5})


@pytest.mark.parametrize("ratio", [None, 0.3])
def test_langchain_llm_under_a_fidelity_target(engine, ratio):
    from qcfuse_integrations.langchain import QCFuseLLM

    fields = {} if ratio is None else {"ratio": ratio}
    llm = QCFuseLLM.from_engine(engine, max_tokens=4, **fields)
    assert llm.ratio == ratio
    _check(llm.generate([PROMPT]).generations[0][0].generation_info, ratio)


@pytest.mark.parametrize("ratio", [None, 0.3])
def test_llama_index_llm_under_a_fidelity_target(engine, ratio):
    from qcfuse_integrations.llama_index import QCFuseLLM

    fields = {} if ratio is None else {"ratio": ratio}
    llm = QCFuseLLM(engine=engine, max_new_tokens=4, **fields)
    assert llm.ratio == ratio
    _check(llm.complete(PROMPT).additional_kwargs["qcfuse"], ratio)
