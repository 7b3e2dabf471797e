"""ChatQCFuse and caches that follow retrieval, in LangChain's plain idiom (issue 19).

The chains here are LangChain's quickstart chains with the QCFuse model swapped in: a
retriever from an in-memory vector store, a `format_docs`, a chat prompt - no QCFuse
ingestion step. The embedded SmolLM2-135M-Instruct answers, greedy and short; tools and
structured output use a tiny random model with a byte tokenizer (scripted where the model
must say something particular).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tools import tool
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel, Field

from qcfuse_core.engine import generation
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.guard import GuardConfig
from qcfuse_core.model.testing import tiny_model
from qcfuse_integrations.langchain import ChatQCFuse, QCFuseCallbackHandler, QCFuseEmbeddings, qcfuse_callback

# the embedded model through the shared per-process model cache: fast tier (tests/README.md)

NEW = 6
FACTS = [
    "Port Halden is a small harbour town on the north coast of Veloria, known for its red lighthouse.",
    "The Zephyr Institute was founded in 1987 by the marine biologist Ada Ferreira at Cape Wrayth.",
    "Every autumn the Lantern Festival fills the harbour of Port Halden with floating paper lanterns.",
    "Veloria's ferries cross to the Skerry Isles twice a day in summer and once a day in winter.",
]
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using only the context."),
    ("human", "Context:\n{context}\n\nQuestion: {question}"),
])


def format_docs(docs):
    return "\n\n".join(d.page_content for d in docs)


@pytest.fixture(scope="module")
def retriever():
    docs = [Document(page_content=t, id=f"fact-{i}", metadata={"source": f"facts/{i}.md"}) for i, t in enumerate(FACTS)]
    return InMemoryVectorStore.from_documents(docs, QCFuseEmbeddings()).as_retriever(search_kwargs={"k": 2})


def fresh_chat(tmp_path, **kw) -> ChatQCFuse:
    """A chat model over a store folder of its own (and so an engine and learner of its own)."""
    kw.setdefault("max_tokens", NEW)
    return ChatQCFuse(store_dir=str(tmp_path), **kw)


def stats(message) -> dict:
    return message.response_metadata["qcfuse"]


# ---------------------------------------------------------------------- the standard suite


_UNIT_STORE = tempfile.mkdtemp(prefix="qcfuse-chat-unit-")


class TestChatQCFuseStandard(ChatModelUnitTests):
    """langchain-tests' standard chat-model unit tests (serialisation is skipped by the suite:
    ChatQCFuse is not lc-serializable - it holds a local model, not an API client)."""

    @property
    def chat_model_class(self):
        return ChatQCFuse

    @property
    def chat_model_params(self) -> dict:
        return {"store_dir": _UNIT_STORE}


# ---------------------------------------------------------------------- caches follow retrieval


def test_lcel_with_a_plain_retriever_and_no_builder_hits_on_the_second_call(tmp_path, retriever):
    chat = fresh_chat(tmp_path)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | chat
    first = chain.invoke("Who founded the Zephyr Institute?")
    second = chain.invoke("Who founded the Zephyr Institute?")
    assert stats(first)["chunks"] == 2 and None not in stats(first)["chunk_ids"]  # learned from the retriever
    assert stats(second)["cache_hits"] == 2 and stats(second)["cache_misses"] == 0
    assert stats(second)["guard"]["signal"] == "first_token_margin" and stats(second)["guard"]["action"]  # issue 53
    assert stats(second)["fidelity"]["config"] == "qcfuse@0.15"  # the configuration and its audited fidelity
    assert stats(second)["fidelity"]["status"] == "fixed" and "measured" in stats(second)["fidelity"]
    assert second.content == first.content  # greedy, same prompt
    assert chat.learner.counters()["unmatched_prompts"] == 0


def test_what_answered_reaches_a_chain_that_ends_in_a_string(tmp_path, retriever):
    """An LCEL chain ending in StrOutputParser returns a bare string; `qcfuse_callback()` (or a
    QCFuseCallbackHandler passed to the run) still gets each call's statistics and the one
    line of what answered - under a guard that escalates everything, the full prefill."""
    chat = fresh_chat(tmp_path)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | chat | StrOutputParser()
    with qcfuse_callback() as cb:
        answer = chain.invoke("Who founded the Zephyr Institute?")
    assert isinstance(answer, str) and len(cb.calls) == 1 and cb.last["chunks"] == 2
    assert cb.answered == cb.last["answered"]
    assert cb.answered.startswith(("qcfuse @ 0.15 · guard: ", "full (escalated by the guard from qcfuse")), cb.answered
    chain.invoke("Who founded the Zephyr Institute?")
    assert len(cb.calls) == 1  # outside the block: not recorded

    escalating = QCFuseEngine(chat.engine.adapter, config=EngineConfig(guard=GuardConfig(threshold=1.0)))
    strict = ChatQCFuse.from_engine(escalating, max_tokens=NEW)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | strict | StrOutputParser()
    handler = QCFuseCallbackHandler()
    asyncio.run(chain.ainvoke("Who founded the Zephyr Institute?", config={"callbacks": [handler]}))
    assert handler.answered.startswith("full (escalated by the guard from qcfuse") and "< 1.00)" in handler.answered
    escalating.close()


def test_a_metadata_header_formatter_hits_on_the_page_contents(tmp_path, retriever):
    chat = fresh_chat(tmp_path)

    def with_headers(docs):
        return "\n\n".join(f"Source: {d.metadata['source']}\n{d.page_content}" for d in docs)

    chain = {"context": retriever | with_headers, "question": RunnablePassthrough()} | PROMPT | chat
    chain.invoke("Where is Port Halden?")
    again = chain.invoke("Where is Port Halden?")
    assert stats(again)["chunks"] == 2 and stats(again)["cache_hits"] == 2  # the span inside each rendering
    assert all(i.startswith("fact-") for i in stats(again)["chunk_ids"])


def test_whitespace_normalising_and_truncating_formatters_hit_next_time(tmp_path, retriever):
    chat = fresh_chat(tmp_path)

    def squash(docs):  # other whitespace (two spaces between words), each text cut to 120 characters
        return "\n\n".join(d.page_content.replace(" ", "  ")[:120] for d in docs)

    chain = {"context": retriever | squash, "question": RunnablePassthrough()} | PROMPT | chat
    question = "When is the Lantern Festival?"
    docs = retriever.invoke(question)
    first = chain.invoke(question)
    assert stats(first)["learned_renderings"] == 2 and stats(first)["chunks"] == 2  # computed now ...
    again = chain.invoke(question)
    assert stats(again)["cache_hits"] == 2  # ... hits next time
    rendered = squash(docs)
    for text, doc in zip(rendered.split("\n\n"), docs):  # labelled with the right ids, never another's
        assert "  " in text and doc.page_content.startswith(" ".join(text.split()))
    assert stats(again)["chunk_ids"] == [d.id for d in docs]


def test_a_truncating_formatter_hits_on_the_first_call(tmp_path, retriever):
    chat = fresh_chat(tmp_path)

    def cut(docs):  # each text cut to 70 characters (inside a word)
        return "\n\n".join(d.page_content[:70] for d in docs)

    chain = {"context": retriever | cut, "question": RunnablePassthrough()} | PROMPT | chat
    question = "When is the Lantern Festival?"
    docs = retriever.invoke(question)
    first = stats(chain.invoke(question))
    # served from the retrieved texts' caches: a truncation's token-aligned prefix is exact; those
    # caches were built for this query's retrieval, so they count as built during it, not as hits
    assert first["cache_hits"] == 0 and first["cache_misses"] == first["cache_built"] == 2
    assert first["learned_renderings"] == 2
    cut_tokens = sum(chat.engine.caches.chunk_tokens(d.page_content[:70])[0].numel() for d in docs)
    assert cut_tokens - 2 * 2 <= first["subspan_tokens"] < cut_tokens  # all but the cut words
    assert first["chunk_ids"] == [d.id for d in docs]
    chat.learner.wait()
    again = stats(chain.invoke(question))  # the renderings' own caches, built in the background
    assert again["cache_hits"] == 2 and again["subspan_tokens"] == 0 and again["chunk_ids"] == [d.id for d in docs]


def test_a_prompt_with_context_that_matches_nothing_warns_once(tmp_path, caplog):
    chat = fresh_chat(tmp_path)
    context = "\n\n".join(f"Note {i}: the tide tables of harbour {i} change with the moon and the wind." * 3
                          for i in range(3))  # pasted by hand: no retriever saw it
    chain = PROMPT | chat
    with caplog.at_level(logging.WARNING, logger="qcfuse_integrations.learning"):
        chain.invoke({"context": context, "question": "When is high tide?"})
        chain.invoke({"context": context, "question": "When is low tide?"})
        chat.invoke("Say hi")  # a plain chat turn is no miss
    warnings = [r for r in caplog.records if "matched no cached chunk" in r.getMessage()]
    assert len(warnings) == 1 and "QCFuseCacheBuilder" in warnings[0].getMessage()
    assert chat.learner.counters()["unmatched_prompts"] == 2


# ---------------------------------------------------------------------- the chat model


def test_chat_without_documents_answers_as_full_prefill(tmp_path):
    chat = fresh_chat(tmp_path)
    messages = [SystemMessage("You are terse."), HumanMessage("Say hi")]
    reply = chat.invoke(messages)
    full = fresh_chat(tmp_path, method="full").invoke(messages)
    assert reply.content and reply.content == full.content
    assert stats(reply)["method"] == "full" and stats(reply)["chunks"] == 0
    # the system prompt is kept: the model saw the template's rendering of both messages
    rendered = chat.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}],
        tokenize=False, add_generation_prompt=True)
    assert reply.usage_metadata["input_tokens"] == len(chat.engine.caches.tokenize(rendered))
    assert reply.usage_metadata["output_tokens"] == stats(reply)["new_tokens"]
    assert chat.get_num_tokens_from_messages(messages) == reply.usage_metadata["input_tokens"]


def test_generation_parameters(tmp_path):
    chat = fresh_chat(tmp_path, max_tokens=12)
    two = chat.invoke("Name a colour.", max_tokens=2)
    assert two.usage_metadata["output_tokens"] == 2 and two.response_metadata["finish_reason"] == "length"
    bound = chat.bind(max_tokens=3).invoke("Name a colour.")
    assert bound.usage_metadata["output_tokens"] == 3
    base = chat.invoke("Count from one to ten.").content
    cut = base.split()[1]
    stopped = chat.invoke("Count from one to ten.", stop=[cut])
    assert cut not in stopped.content and base.startswith(stopped.content)
    a = chat.invoke("Name a colour.", temperature=1.0, top_p=0.9, seed=7).content
    assert a == chat.invoke("Name a colour.", temperature=1.0, top_p=0.9, seed=7).content  # seeded
    assert chat.invoke("Name a colour.", repetition_penalty=1.3, top_k=5).content
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['max_length'\]; valid: .*max_tokens"):
        chat.invoke("hi", max_length=3)
    params = chat._get_ls_params(stop=["x"])
    assert params["ls_model_name"] == "SmolLM2-135M-Instruct" and params["ls_max_tokens"] == 12
    assert params["ls_stop"] == ["x"] and params["ls_model_type"] == "chat"


def test_invoke_batch_stream_and_async(tmp_path):
    chat = fresh_chat(tmp_path)
    prompts = ["Say hi", "Name a fruit."]
    want = [chat.invoke(p) for p in prompts]
    got = chat.batch(prompts)  # LangChain runs a batch on a thread pool: two requests at once
    assert [m.content for m in got] == [m.content for m in want]
    chunks = list(chat.stream(prompts[0]))
    assert "".join(c.content for c in chunks) == want[0].content
    assert chunks[-1].usage_metadata["output_tokens"] == want[0].usage_metadata["output_tokens"]
    assert chunks[-1].response_metadata["qcfuse"]["new_tokens"] == stats(want[0])["new_tokens"]

    async def run():
        one = await chat.ainvoke(prompts[0])
        parts = [c.content async for c in chat.astream(prompts[1])]
        events = [e async for e in chat.astream_events(prompts[0], version="v2")]
        both = await asyncio.gather(chat.ainvoke(prompts[0]), chat.ainvoke(prompts[1]))
        return one, parts, events, both

    one, parts, events, both = asyncio.run(run())
    assert one.content == want[0].content and "".join(parts) == want[1].content
    kinds = [e["event"] for e in events]
    assert kinds[0] == "on_chat_model_start" and "on_chat_model_stream" in kinds and kinds[-1] == "on_chat_model_end"
    assert events[-1]["data"]["output"].usage_metadata["output_tokens"] == want[0].usage_metadata["output_tokens"]
    assert [m.content for m in both] == [m.content for m in want]


# ---------------------------------------------------------------------- tools, structured output


@pytest.fixture(scope="module")
def tiny_chat():
    """A tiny random model whose byte tokenizer has a plain chat template (no tool support)."""
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return ChatQCFuse.from_engine(QCFuseEngine(adapter), max_tokens=120)


def script(monkeypatch, text: str) -> None:
    """The model says `text` (byte tokens), then ends: the sampler's choice is scripted."""
    ids = list(text.encode()) + [0]  # byte 0 is EOS

    def pick(self, logits):
        self._script = getattr(self, "_script", iter(ids))
        return next(self._script)

    monkeypatch.setattr(generation.Sampler, "_pick", pick)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_tool_calls_round_trip_on_a_scripted_model(tiny_chat, monkeypatch):
    script(monkeypatch, 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    with_tools = tiny_chat.bind_tools([add])
    msg = with_tools.invoke("What is 2 + 3?")
    assert isinstance(msg, AIMessage) and msg.content == "Let me add."
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 2, "b": 3})]
    result = add.invoke(msg.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.content == "5"
    script(monkeypatch, "It is 5.")
    final = with_tools.invoke([HumanMessage("What is 2 + 3?"), msg, result])  # the history renders
    assert final.content == "It is 5." and final.tool_calls == []
    script(monkeypatch, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
    streamed = list(with_tools.stream("What is 1 + 1?"))
    whole = streamed[0]
    for part in streamed[1:]:
        whole = whole + part
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("add", {"a": 1, "b": 1})]
    with pytest.raises(ValueError, match="names no bound tool; valid: .*add"):
        tiny_chat.bind_tools([add], tool_choice="subtract")


def test_forced_tool_call_and_structured_output_parse_on_a_random_model(tiny_chat):
    """Constrained decoding: a random model's output still matches the schema and parses."""
    class Verdict(BaseModel):
        ok: bool = Field(description="whether it holds")
        colour: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})

    verdict = tiny_chat.with_structured_output(Verdict).invoke("Is the sea green?")
    assert isinstance(verdict, Verdict) and verdict.colour in ("red", "green", "blue")
    raw = tiny_chat.with_structured_output(Verdict, include_raw=True).invoke("Is the sea green?")
    assert raw["parsing_error"] is None and raw["parsed"] == verdict and isinstance(raw["raw"], AIMessage)
    as_dict = tiny_chat.with_structured_output(Verdict.model_json_schema(), method="function_calling").invoke("Hi")
    assert set(as_dict) == {"ok", "colour"}

    @tool
    def shout(word: bool) -> str:
        """Shout or not."""
        return "!" if word else "."

    msg = tiny_chat.bind_tools([shout], tool_choice="shout").invoke("Shout?")
    assert [c["name"] for c in msg.tool_calls] == ["shout"] and isinstance(msg.tool_calls[0]["args"]["word"], bool)
