"""One end-to-end answer per public path on the embedded SmolLM2-135M-Instruct, in the fast
tier (tests/README.md): the engine, LangChain's chat model, LlamaIndex's LLM, the OpenAI
server and the studio's API. Each serves a short RAG question over three chunks built at
ingestion, and each answer is the engine's own answer to the same prompt: the paths add
nothing and lose nothing. One engine over the shared model (`smol`, fp32), greedy, 6 tokens.

The deeper checks of each path run on tiny random models in their own files (test_serve.py,
test_langchain_chat.py, test_llama_index.py, test_studio_parts.py), and on the embedded model
over the sample corpus in the slow tier (test_langchain.py, test_studio_api.py)."""

from __future__ import annotations

import pytest

from qcfuse_core import EngineConfig
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.eval.hooks import internals
from qcfuse_core.store import MemoryStore

DOCS = [
    "The Orvell Lighthouse stands on Kettle Point. It was built in 1871 by the harbour board of Marrowby.",
    "Marrowby is a fishing town twenty miles north of Kettle Point.",
    "The first keeper of the Orvell Lighthouse, Ada Brisk, was born in Kettle Point.",
]
IDS = ["lighthouse", "marrowby", "keeper"]
Q = "Where was the first keeper of the Orvell Lighthouse born?"
NEW = 6


@pytest.fixture(scope="module")
def engine(smol):
    eng = QCFuseEngine(smol, store=MemoryStore(), config=EngineConfig())
    eng.build_chunks(DOCS, IDS)
    return eng


@pytest.fixture(scope="module")
def want(engine):
    """The engine's answer to the RAG prompt as the frameworks render it (their own templates
    put the chunks in the user message; `complete` finds them by content)."""
    return engine.complete(_prompt(), max_new_tokens=NEW, temperature=0.0)


def _prompt() -> str:
    return "Context:\n" + "\n\n".join(DOCS) + f"\n\nQuestion: {Q}"


def test_the_engine_answers_from_its_chunk_caches(engine):
    got = engine.answer(Q, DOCS, node_ids=IDS, max_new_tokens=NEW)
    assert got.text and len(got.token_ids) <= NEW
    assert (got.cache_hits, got.cache_misses, got.cache_built) == (3, 0, 0)
    assert 0 < got.recomputed_tokens < got.context_tokens  # fused: only the selected rows
    full = engine.answer(Q, DOCS, node_ids=IDS, method="full", max_new_tokens=NEW)
    assert full.recomputed_tokens == full.context_tokens
    assert engine.answer(Q, DOCS, node_ids=IDS, max_new_tokens=NEW).token_ids == got.token_ids  # repeatable


def test_the_completion_finds_the_chunks_in_a_rendered_prompt(want):
    assert want.text and want.cache_hits == 3 and want.cache_misses == 0


def test_langchain_chat_model(engine, want):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import HumanMessage, SystemMessage

    from qcfuse_integrations.langchain import ChatQCFuse

    chat = ChatQCFuse.from_engine(engine, max_tokens=NEW, temperature=0.0)
    msg = chat.invoke([SystemMessage(engine.config.frame.system_prompt), HumanMessage(_prompt())])
    assert msg.content == want.text
    stats = msg.response_metadata["qcfuse"]
    assert stats["cache_hits"] == 3 and stats["cache_misses"] == 0


def test_llama_index_llm(engine, want):
    pytest.importorskip("llama_index.core")
    from qcfuse_integrations.llama_index import QCFuseLLM

    llm = QCFuseLLM(engine=engine, max_new_tokens=NEW, temperature=0.0)
    got = llm.complete(_prompt())
    assert got.text == want.text
    assert got.raw["qcfuse"]["cache_hits"] == 3


def test_the_openai_server(engine, want):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qcfuse_core.serve.app import create_app

    with TestClient(create_app(engine, model_name="smollm2")) as client:
        res = client.post("/v1/completions", json={"model": "smollm2", "prompt": _prompt(), "max_tokens": NEW,
                                                   "temperature": 0})
        assert res.status_code == 200, res.text
        body = res.json()
        assert body["choices"][0]["text"] == want.text
        assert body["usage"]["prompt_tokens"] == want.prompt_tokens
        assert body["qcfuse"]["cache_hits"] == 3 and sorted(body["qcfuse"]["chunk_ids"]) == sorted(IDS)


def test_the_studio_api(engine, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qcfuse_core.studio.app import create_app
    from qcfuse_core.studio.service import StudioConfig, StudioService

    svc = StudioService(StudioConfig(store=tmp_path / "studio", dtype="fp32", warmup=False),
                        engine=internals(engine).replace(store=MemoryStore()))
    with TestClient(create_app(svc)) as client:
        assert client.get("/").status_code == 200  # the page hands out the token the studio's writes need
        files = [("files", (f"{i}.md", text.encode(), "text/markdown")) for i, text in zip(IDS, DOCS)]
        res = client.post("/api/ingest", files=files)
        assert res.status_code in (200, 202), res.text
        job = res.json()
        if res.status_code == 202:  # ingestion runs as a job: wait for it, bounded
            job = _wait_job(client, job["id"])
        top = client.post("/api/search", json={"question": Q, "top_k": 3}).json()["chunks"]
        assert len(top) == 3
        body = {"question": Q, "chunk_ids": [c["id"] for c in top], "max_new_tokens": NEW,
                "modes": [{"method": "qcfuse", "ratio": 0.15}, {"method": "full"}]}
        res = client.post("/api/run", json=body)
        assert res.status_code == 200, res.text
        fused, full = res.json()["results"]
    texts = [c["text"] for c in top]
    alone = engine.answer(Q, texts, method="qcfuse", ratio=0.15, max_new_tokens=NEW)
    assert fused["answer"] == alone.text and fused["cache_hits"] == 3
    assert full["recomputed_tokens"] == full["context_tokens"]


def _wait_job(client, job_id: str) -> dict:
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["state"] in ("done", "failed"):
            assert job["state"] == "done", job
            return job
        time.sleep(0.1)
    raise AssertionError(f"ingest job {job_id} did not finish in 120 s")
