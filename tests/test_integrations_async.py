"""The integrations' async methods on the engine's async API (issue 36): LangChain's
`ainvoke` / `astream` / `abatch` and LlamaIndex's `acomplete` / `astream_complete` /
`achat` / `astream_chat` answer exactly as their sync twins, submit straight to the
scheduler (no thread per call, so N calls gathered are one decode batch of N), and a
cancelled or closed async stream aborts its request. LangChain's sync `batch` enters the
scheduler together too.

A tiny random model (fp32, CPU) with a byte tokenizer and a plain chat template; a fresh
engine per test wherever the scheduler's counters are read. Greedy; NEW tokens are enough
for a batch to form (the first request admitted is still decoding when the last joins).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from qcfuse_core.engine.api import QCFuseEngine  # noqa: E402
from qcfuse_core.model.testing import tiny_model  # noqa: E402
from qcfuse_integrations.langchain import ChatQCFuse  # noqa: E402
from qcfuse_integrations.langchain import QCFuseLLM as LangChainLLM  # noqa: E402
from qcfuse_integrations.llama_index import QCFuseLLM as LlamaIndexLLM  # noqa: E402

NEW = 16
PROMPTS = [f"Question {i}: what is {i} plus {i}?" for i in range(4)]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny():
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = TEMPLATE
    return adapter


@pytest.fixture
def engine(tiny) -> QCFuseEngine:
    """A fresh engine (its scheduler's counters start at zero) on the shared tiny model."""
    return QCFuseEngine(tiny)


@pytest.fixture
def no_threads(monkeypatch, engine):
    """The async path runs no call in a thread: an executor or `asyncio.to_thread` raises,
    the only threads started are the scheduler's worker (and the retrieval learner's one
    background builder), and every request comes through the engine's async API
    (its one async submission path, `_astream`). Yields the number of async requests so far."""
    def refuse(*args, **kwargs):
        raise AssertionError("the async path handed a call to a thread")

    started: list[str] = []
    start = threading.Thread.start

    def record(self):
        started.append(self.name)
        return start(self)

    monkeypatch.setattr(asyncio.BaseEventLoop, "run_in_executor", refuse)
    monkeypatch.setattr(asyncio, "to_thread", refuse)
    monkeypatch.setattr(threading.Thread, "start", record)
    asynchronous = engine._astream
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return asynchronous(*args, **kwargs)

    monkeypatch.setattr(engine, "_astream", counted)
    yield count
    # besides an engine's scheduler worker, only an engine's retrieval learner may start its
    # one background build thread (a pool of one worker, `qcfuse-learn_0`, for the engine's
    # life: it builds texts that retrievers of this process returned, whichever test saw
    # them) - never a thread per call
    assert set(started) <= {"qcfuse-scheduler", "qcfuse-learn_0"}, started


def _sync_only(monkeypatch, engine):
    """From here on a request through the engine's async API raises (the sync twins' runs)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a sync method used the async API")

    monkeypatch.setattr(engine, "_astream", refuse)


async def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


def _stats(result) -> dict:
    """A response's fusion statistics without what differs run to run: the timings, the CPU
    threads the request ran with (chosen per request from the machine's load, engine/threads.py),
    and the snapshot of the engine's store counters taken as the request ended - engine-wide
    state, which the learner's background builds also change: a new engine learns every text
    retrieved earlier in the process (qcfuse_integrations/learning.py), so after other tests'
    retrievals its entry count grows between two requests of this test."""
    drop = ("timings_ms", "unmatched_prompts", "threads", "store")
    return {k: v for k, v in result.items() if not k.endswith("_ms") and k not in drop}


# ---------------------------------------------------------------------- LangChain


KINDS = ["chat", "llm"]  # ChatQCFuse, LangChain's QCFuseLLM


def _component(engine: QCFuseEngine, kind: str):
    if kind == "chat":
        return ChatQCFuse.from_engine(engine, max_tokens=NEW)
    return LangChainLLM.from_engine(engine, max_new_tokens=NEW)


def _text(reply) -> str:
    """An answer's (or a streamed chunk's) text: chat messages carry it as `content`."""
    return reply if isinstance(reply, str) else reply.content


def _sequential(tiny, kind: str) -> list[str]:
    """The four prompts one `invoke` after another, on a fresh engine."""
    eng = QCFuseEngine(tiny)
    component = _component(eng, kind)
    out = [_text(component.invoke(p)) for p in PROMPTS]
    assert eng.stats().scheduler.max_batch_seen == 1  # one at a time
    assert all(len(t) > 4 for t in out)  # answers long enough to share decode steps
    return out


@pytest.mark.parametrize("kind", KINDS)
async def test_langchain_abatch_is_one_decode_batch(tiny, engine, kind, monkeypatch):
    want = _sequential(tiny, kind)
    monkeypatch.setattr(asyncio.BaseEventLoop, "run_in_executor", lambda *a, **k: pytest.fail("executor used"))
    got = await _component(engine, kind).abatch(PROMPTS)
    assert [_text(r) for r in got] == want
    s = engine.stats().scheduler
    assert (s.submitted, s.finished, s.max_batch_seen) == (4, 4, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_langchain_sync_batch_enters_the_scheduler_together(tiny, engine, kind):
    want = _sequential(tiny, kind)
    got = _component(engine, kind).batch(PROMPTS)
    assert [_text(r) for r in got] == want
    s = engine.stats().scheduler
    assert (s.submitted, s.finished, s.max_batch_seen) == (4, 4, 4)


async def test_langchain_chat_batch_inside_a_running_loop(tiny, engine):
    """A sync `batch` called from a coroutine runs its own loop in a helper thread."""
    want = _sequential(tiny, "chat")
    got = _component(engine, "chat").batch(PROMPTS)
    assert [_text(r) for r in got] == want and engine.stats().scheduler.max_batch_seen == 4


@pytest.mark.parametrize("kind", KINDS)
async def test_langchain_ainvoke_astream_equal_invoke_stream(engine, kind, monkeypatch):
    component = _component(engine, kind)
    _sync_only(monkeypatch, engine)
    sync_reply = component.invoke(PROMPTS[0])
    sync_chunks = list(component.stream(PROMPTS[1]))
    monkeypatch.undo()

    calls = 0
    asynchronous = engine._astream

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return asynchronous(*args, **kwargs)

    monkeypatch.setattr(engine, "_astream", counted)
    monkeypatch.setattr(engine, "_stream", lambda *a, **k: pytest.fail("the async path used the sync API"))
    monkeypatch.setattr(asyncio.BaseEventLoop, "run_in_executor", lambda *a, **k: pytest.fail("executor used"))
    monkeypatch.setattr(asyncio, "to_thread", lambda *a, **k: pytest.fail("to_thread used"))
    async_reply = await component.ainvoke(PROMPTS[0])
    async_chunks = [c async for c in component.astream(PROMPTS[1])]
    assert calls == 2
    assert _text(async_reply) == _text(sync_reply) and _text(sync_reply)
    assert [_text(c) for c in async_chunks] == [_text(c) for c in sync_chunks] and len(async_chunks) > 2
    if kind == "chat":
        assert async_reply.usage_metadata == sync_reply.usage_metadata
        assert _stats(async_reply.response_metadata["qcfuse"]) == _stats(sync_reply.response_metadata["qcfuse"])
        assert async_chunks[-1].usage_metadata == sync_chunks[-1].usage_metadata


async def test_langchain_ainvoke_uses_no_thread(engine, no_threads):
    chat = ChatQCFuse.from_engine(engine, max_tokens=NEW)
    llm = LangChainLLM.from_engine(engine, max_new_tokens=NEW)
    await chat.ainvoke(PROMPTS[0])
    [c async for c in chat.astream(PROMPTS[1])]
    await llm.ainvoke(PROMPTS[2])
    [c async for c in llm.astream(PROMPTS[3])]
    await llm.abatch(PROMPTS)
    await chat.abatch(PROMPTS)
    streaming = ChatQCFuse.from_engine(engine, max_tokens=NEW, streaming=True)  # ainvoke merges its stream
    assert (await streaming.ainvoke(PROMPTS[0])).content == (await chat.ainvoke(PROMPTS[0])).content
    assert no_threads[0] == 14


async def test_langchain_structured_output_async_equals_sync(engine, monkeypatch):
    """Compiling the JSON schema is synchronous (llguidance): the async path compiles it in
    `asyncio.to_thread`, then decodes on the engine's async API like any call."""
    class Verdict(BaseModel):
        ok: bool = Field(description="whether it holds")
        colour: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})

    chat = ChatQCFuse.from_engine(engine, max_tokens=60)
    want = chat.with_structured_output(Verdict).invoke("Is the sea green?")
    offloaded = []
    to_thread = asyncio.to_thread

    def spy(fn, *args, **kwargs):
        offloaded.append(fn)
        return to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", spy)
    got = await chat.with_structured_output(Verdict).ainvoke("Is the sea green?")
    assert got == want and len(offloaded) == 1


async def test_a_cancelled_langchain_astream_aborts_its_request(engine, monkeypatch):
    given: list[object] = []
    give = engine.kv_budget.release
    monkeypatch.setattr(engine.kv_budget, "release", lambda r: (given.append(r), give(r)))
    chat = ChatQCFuse.from_engine(engine, max_tokens=400)
    decoding = asyncio.Event()

    async def reader() -> None:
        async for _ in chat.astream(PROMPTS[0]):
            decoding.set()

    task = asyncio.create_task(reader())
    await decoding.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: engine.stats().scheduler.aborted == 1)
    s = engine.stats().scheduler
    assert (s.submitted, s.finished, s.aborted, s.running) == (1, 0, 1, 0)
    assert len([c for c in given if c is not None]) == 1  # its KV cache went back to the pool

    llm = LangChainLLM.from_engine(engine, max_new_tokens=400)
    stream = llm.astream(PROMPTS[1])
    assert await stream.__anext__() is not None
    await stream.aclose()  # a consumer that stops reading
    await _until(lambda: engine.stats().scheduler.aborted == 2)
    assert engine.stats().scheduler.finished == 0


# ---------------------------------------------------------------------- LlamaIndex


def _messages(i: int) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.SYSTEM, content="Answer briefly."),
            ChatMessage(role=MessageRole.USER, content=PROMPTS[i])]


async def test_llama_index_async_twins_equal_sync(engine, monkeypatch):
    llm = LlamaIndexLLM(engine=engine, max_new_tokens=NEW)
    _sync_only(monkeypatch, engine)
    want_complete = llm.complete(PROMPTS[0])
    want_streamed = list(llm.stream_complete(PROMPTS[1]))
    want_chat = llm.chat(_messages(2))
    want_chat_streamed = list(llm.stream_chat(_messages(3)))
    monkeypatch.undo()

    calls = 0
    asynchronous = engine._astream

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return asynchronous(*args, **kwargs)

    monkeypatch.setattr(engine, "_astream", counted)
    monkeypatch.setattr(engine, "_stream", lambda *a, **k: pytest.fail("the async path used the sync API"))
    monkeypatch.setattr(asyncio.BaseEventLoop, "run_in_executor", lambda *a, **k: pytest.fail("executor used"))
    monkeypatch.setattr(asyncio, "to_thread", lambda *a, **k: pytest.fail("to_thread used"))
    got_complete = await llm.acomplete(PROMPTS[0])
    got_streamed = [r async for r in await llm.astream_complete(PROMPTS[1])]
    got_chat = await llm.achat(_messages(2))
    got_chat_streamed = [r async for r in await llm.astream_chat(_messages(3))]
    assert calls == 4

    assert got_complete.text == want_complete.text and want_complete.text
    assert _stats(got_complete.additional_kwargs["qcfuse"]) == _stats(want_complete.additional_kwargs["qcfuse"])
    assert got_complete.raw["usage"] == want_complete.raw["usage"]
    assert [(r.text, r.delta) for r in got_streamed] == [(r.text, r.delta) for r in want_streamed]
    assert got_streamed[-1].raw["usage"] == want_streamed[-1].raw["usage"]
    assert got_chat.message.content == want_chat.message.content and want_chat.message.content
    assert _stats(got_chat.additional_kwargs["qcfuse"]) == _stats(want_chat.additional_kwargs["qcfuse"])
    assert [(r.message.content, r.delta) for r in got_chat_streamed] == [
        (r.message.content, r.delta) for r in want_chat_streamed]
    assert got_chat_streamed[-1].raw["usage"] == want_chat_streamed[-1].raw["usage"]


async def test_llama_index_gathered_acompletes_are_one_decode_batch(tiny, engine, no_threads):
    alone = QCFuseEngine(tiny)
    want = [LlamaIndexLLM(engine=alone, max_new_tokens=NEW).complete(p).text for p in PROMPTS]
    llm = LlamaIndexLLM(engine=engine, max_new_tokens=NEW)
    got = await asyncio.gather(*(llm.acomplete(p) for p in PROMPTS))
    assert [r.text for r in got] == want
    s = engine.stats().scheduler
    assert (s.submitted, s.finished, s.max_batch_seen) == (4, 4, 4)
    replies = await asyncio.gather(*(llm.achat(_messages(i)) for i in range(4)))
    assert all(r.message.content for r in replies) and no_threads[0] == 8


async def test_llama_index_structured_predict_async_equals_sync(engine):
    class Town(BaseModel):
        coastal: bool
        size: str = Field(json_schema_extra={"enum": ["small", "large"]})

    llm = LlamaIndexLLM(engine=engine, max_new_tokens=60)
    prompt = PromptTemplate("Describe {name} as JSON.")
    want = llm.structured_predict(Town, prompt, name="Port Halden")
    assert await llm.astructured_predict(Town, prompt, name="Port Halden") == want


async def test_a_closed_llama_index_astream_aborts_its_request(engine):
    llm = LlamaIndexLLM(engine=engine, max_new_tokens=400)
    for stream in (await llm.astream_complete(PROMPTS[0]), await llm.astream_chat(_messages(1))):
        assert (await stream.__anext__()).delta
        await stream.aclose()
    await _until(lambda: engine.stats().scheduler.aborted == 2)
    s = engine.stats().scheduler
    assert (s.submitted, s.finished, s.running) == (2, 0, 0)

    async def reader() -> None:
        async for _ in await llm.astream_complete(PROMPTS[2]):
            pass

    task = asyncio.create_task(reader())
    await _until(lambda: engine.stats().scheduler.steps > s.steps + 2)  # it is decoding
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: engine.stats().scheduler.aborted == 3)
    assert engine.stats().scheduler.finished == 0


# ---------------------------------------------------------------------- background builds


async def test_an_async_call_waiting_for_a_background_build_leaves_the_loop_running(engine, monkeypatch):
    """A prompt holding a retrieved text whose cache is still being built waits for that
    build (no double work) - awaited, not blocking: another coroutine keeps ticking while
    the call waits, and the call then serves the text from the cache built for it."""
    from qcfuse_core import GenerationConfig
    from qcfuse_integrations.base import Call, GenerationOptions
    from qcfuse_integrations.learning import learner_for

    doc = "The lighthouse of Cape Wrayth was built in 1871 and painted red in 1902."
    monkeypatch.setattr(asyncio, "to_thread", lambda *a, **k: pytest.fail("to_thread used"))
    monkeypatch.setattr(asyncio.BaseEventLoop, "run_in_executor", lambda *a, **k: pytest.fail("executor used"))
    gate, ticks, at_release = threading.Event(), [0], []
    build = engine.build_chunks

    def slow_build(texts, node_ids=None, **kw):
        if doc in texts:
            gate.wait(30)
        return build(texts, node_ids, **kw)

    monkeypatch.setattr(engine, "build_chunks", slow_build)
    learner = learner_for(engine)
    learner.see([(doc, "lighthouse")])  # its cache is built in the background, held at the gate

    def release() -> None:
        at_release.append(ticks[0])
        gate.set()

    timer = threading.Timer(1.0, release)  # a loop blocked by the wait would still end, after it
    timer.start()

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.01)
            ticks[0] += 1

    task = asyncio.create_task(ticker())
    try:
        options = GenerationOptions("naive", 0.15, GenerationConfig(max_new_tokens=4))
        call = Call(f"Context: {doc}\nWhen was it built?", False, options)
        stream = await call.aopen(engine)
        deltas = [d async for d in call.adeltas(engine, stream)]
    finally:
        task.cancel()
        timer.cancel()
    assert at_release and at_release[0] >= 20, "the event loop was blocked while the call waited for the build"
    assert [(c.text, c.node_id) for c in call.chunks] == [(doc, "lighthouse")]
    assert call.built == 1 and call.build_wait_ms >= 500 and call.result.text == "".join(deltas)
