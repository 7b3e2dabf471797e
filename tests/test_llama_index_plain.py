"""QCFuseLLM in LlamaIndex's plain idiom (issue 19): the starter tutorial with QCFuse as
`Settings.llm`, no QCFuse ingestion step, chat without documents, the parameters LlamaIndex
users pass, structured output and tool calls.

A store folder of its own (so an engine and learner of its own); the embedded
SmolLM2-135M-Instruct, greedy and short. Tool calls use a tiny random model, scripted.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from qcfuse_core.engine import generation  # noqa: E402
from qcfuse_core.engine.api import QCFuseEngine  # noqa: E402
from qcfuse_core.engine.config import EngineConfig  # noqa: E402
from qcfuse_core.engine.guard import GuardConfig  # noqa: E402
from qcfuse_core.model.testing import tiny_model  # noqa: E402
from qcfuse_integrations.llama_index import FusionStats, QCFuseEmbedding, QCFuseLLM  # noqa: E402

# the embedded model through the shared per-process model cache: fast tier (tests/README.md)

NEW = 6
TEXTS = [
    "The Zephyr Institute was founded in 1987 by the marine biologist Ada Ferreira at Cape Wrayth.",
    "Port Halden is a small harbour town on the north coast of Veloria, known for its red lighthouse.",
    "Every autumn the Lantern Festival fills the harbour of Port Halden with floating paper lanterns.",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("li-plain"))


@pytest.fixture(autouse=True)
def _settings(store):
    old = Settings._llm, Settings._embed_model
    Settings.llm = QCFuseLLM(store_dir=store, max_new_tokens=NEW)
    Settings.embed_model = QCFuseEmbedding()
    yield
    Settings._llm, Settings._embed_model = old


@pytest.fixture
def fusion():
    handler = FusionStats.attach()
    yield handler
    handler.detach()


def test_from_documents_and_as_query_engine_hit_on_the_second_query(fusion):
    index = VectorStoreIndex.from_documents([Document(text=t) for t in TEXTS])
    query_engine = index.as_query_engine(similarity_top_k=2)
    first = query_engine.query("Who founded the Zephyr Institute?")
    second = query_engine.query("Who founded the Zephyr Institute?")
    (_, a), (_, b) = fusion.events[-2:]
    assert a["chunks"] == 2 and a["chunk_ids"] == [n.node.node_id for n in first.source_nodes]
    assert (a["cache_hits"], a["cache_built"]) == (0, 2)  # built for the cold query: not hits
    assert b["cache_hits"] == 2 and b["cache_misses"] == 0
    assert str(first) == str(second)


def test_a_query_engines_response_says_what_answered(fusion):
    """`Response.metadata["qcfuse"]`: the statistics of the LLM call that wrote the answer,
    with `answered` (what answered and what the quality guard did); concurrent async
    queries each get their own call's; a guard that escalates everything shows on it."""
    index = VectorStoreIndex.from_documents([Document(text=t) for t in TEXTS])
    response = index.as_query_engine(similarity_top_k=2).query("Who founded the Zephyr Institute?")
    got = response.metadata["qcfuse"]
    assert got["answered"] == fusion.last["answered"] and got["llm_calls"] == 1
    assert got["chunk_ids"] == [n.node.node_id for n in response.source_nodes]
    assert got["answered"].startswith(("qcfuse @ 0.15 · guard: ", "full (escalated by the guard from qcfuse"))

    async def both():
        qe = index.as_query_engine(similarity_top_k=1)
        return await asyncio.gather(qe.aquery("Who founded the Zephyr Institute?"),
                                    qe.aquery("What fills the harbour of Port Halden every autumn?"))

    for r in asyncio.run(both()):
        assert r.metadata["qcfuse"]["chunk_ids"] == [r.source_nodes[0].node.node_id]

    escalating = QCFuseEngine(Settings.llm.engine.adapter, config=EngineConfig(guard=GuardConfig(threshold=1.0)))
    llm = QCFuseLLM(engine=escalating, max_new_tokens=NEW)
    r = index.as_query_engine(llm=llm, similarity_top_k=2).query("Who founded the Zephyr Institute?")
    line = r.metadata["qcfuse"]["answered"]
    assert line.startswith("full (escalated by the guard from qcfuse") and "< 1.00)" in line, line
    escalating.close()


def test_chat_without_documents_answers_as_full_prefill(store):
    llm = Settings.llm
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="You are terse."),
                ChatMessage(role=MessageRole.USER, content="Say hi")]
    reply = llm.chat(messages)
    full = QCFuseLLM(store_dir=store, method="full", max_new_tokens=NEW).chat(messages)
    assert reply.message.content and reply.message.content == full.message.content
    assert reply.raw["qcfuse"]["method"] == "full" and reply.raw["qcfuse"]["chunks"] == 0
    streamed = list(llm.stream_chat(messages))
    assert streamed[-1].message.content == reply.message.content
    assert asyncio.run(llm.achat(messages)).message.content == reply.message.content

    async def astream():
        return [r async for r in await llm.astream_chat(messages)]

    assert "".join(r.delta or "" for r in asyncio.run(astream())) == reply.message.content
    assert llm.metadata.is_chat_model


def test_chat_engines_answer(fusion):
    index = VectorStoreIndex.from_documents([Document(text=t) for t in TEXTS])
    assert str(index.as_chat_engine(chat_mode="simple").chat("Say hi"))
    engine = index.as_chat_engine(chat_mode="condense_plus_context", similarity_top_k=2)
    engine.chat("Who founded the Zephyr Institute?")
    assert fusion.last["chunks"] == 2  # the retrieved context, found inside the chat turn
    reply = engine.stream_chat("And in which year?")
    assert "".join(reply.response_gen)
    assert fusion.last["chunks"] == 2  # the answer's call, not the condense call before it


def test_parameters_and_unknown_keywords(store):
    llm = Settings.llm
    two = llm.complete("Name a colour.", max_tokens=2)
    assert two.raw["qcfuse"]["new_tokens"] == 2 and two.raw["qcfuse"]["finish_reason"] == "length"
    assert llm.complete("Name a colour.", top_p=0.9, top_k=5, temperature=0.7, seed=1, repetition_penalty=1.2).text
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['max_length'\]; valid: .*max_tokens"):
        llm.complete("hi", max_length=3)
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['beams'\]"):
        llm.chat([ChatMessage(role=MessageRole.USER, content="hi")], beams=2)


def test_a_users_prompt_templates_are_honoured(store):
    def messages_to_prompt(messages):
        return "".join(f"{m.role.value}: {m.content}\n" for m in messages) + "assistant:"

    def completion_to_prompt(prompt):
        return f"Q: {prompt}\nA:"

    llm = QCFuseLLM(store_dir=store, max_new_tokens=NEW, messages_to_prompt=messages_to_prompt,
                    completion_to_prompt=completion_to_prompt)
    msgs = [ChatMessage(role=MessageRole.USER, content="Say hi")]
    reply = llm.chat(msgs)  # exactly the user's rendering, no chat frame around it
    assert reply.raw["qcfuse"]["prompt_tokens"] == len(llm.engine.caches.tokenize(messages_to_prompt(msgs)))
    done = llm.complete("Say hi")
    assert done.raw["qcfuse"]["prompt_tokens"] == len(llm.engine.caches.tokenize(completion_to_prompt("Say hi")))


def test_token_counts_reach_the_token_counter(store):
    counter = TokenCountingHandler(tokenizer=lambda text: [0] * len(text.split()))
    llm = QCFuseLLM(store_dir=store, max_new_tokens=NEW, callback_manager=CallbackManager([counter]))
    reply = llm.complete("Say hi")
    assert counter.prompt_llm_token_count == reply.raw["usage"]["prompt_tokens"] > 10  # the frame included
    assert counter.completion_llm_token_count == reply.raw["usage"]["completion_tokens"]


def test_structured_predict_parses(store):
    from llama_index.core.prompts import PromptTemplate

    class Town(BaseModel):
        coastal: bool
        size: str = Field(json_schema_extra={"enum": ["small", "large"]})

    llm = QCFuseLLM(store_dir=store, max_new_tokens=40)
    town = llm.structured_predict(Town, PromptTemplate("Describe {name} as JSON."), name="Port Halden")
    assert isinstance(town, Town) and town.size in ("small", "large")
    town2 = llm.as_structured_llm(Town).complete("Describe Port Halden.").raw
    assert isinstance(town2, Town)


def test_function_calling_on_a_scripted_model(monkeypatch):
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    llm = QCFuseLLM(engine=QCFuseEngine(adapter), max_new_tokens=120)
    said = list(b'<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>') + [0]

    def pick(self, logits):
        self._script = getattr(self, "_script", iter(said))
        return next(self._script)

    monkeypatch.setattr(generation.Sampler, "_pick", pick)

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    tool = FunctionTool.from_defaults(fn=add)
    response = llm.chat_with_tools([tool], user_msg="What is 2 + 3?")
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert json.loads(response.message.additional_kwargs["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    # the model's own choice (predict_and_call forces the call by default since issue 40, decoding a
    # bare JSON call under the schema: tests/test_tool_loop.py); here the scripted text call is parsed
    out = llm.predict_and_call([tool], user_msg="What is 2 + 3?", tool_required=False)
    assert str(out) == "5"


# ---------------------------------------------------------------------- agents (agent workflows)


def scripted_llm(monkeypatch, *replies: str) -> QCFuseLLM:
    """A QCFuseLLM over a tiny random model whose successive calls say `replies` (byte tokens,
    then the end token): the sampler's choices are scripted, the engine runs as usual."""
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    scripts = iter([list(r.encode()) + [0] for r in replies])

    def pick(self, logits):
        if not hasattr(self, "_script"):  # one Sampler per call: the next reply
            self._script = iter(next(scripts))
        return next(self._script)

    monkeypatch.setattr(generation.Sampler, "_pick", pick)
    return QCFuseLLM(engine=QCFuseEngine(adapter), max_new_tokens=200)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def run_agent(agent, question: str):
    async def go():
        handler = agent.run(user_msg=question)
        events = [type(e).__name__ async for e in handler.stream_events()]
        return await handler, events

    return asyncio.run(go())


@pytest.mark.parametrize("streaming", [True, False])
def test_react_agent_calls_a_tool_then_answers(monkeypatch, streaming):
    from llama_index.core.agent.workflow import ReActAgent

    llm = scripted_llm(monkeypatch,
                       'Thought: I need a tool to add the numbers.\nAction: add\nAction Input: {"a": 2, "b": 3}',
                       "Thought: I can answer without using any more tools.\nAnswer: 2 + 3 is 5.")
    agent = ReActAgent(tools=[FunctionTool.from_defaults(fn=add)], llm=llm, streaming=streaming)
    result, events = run_agent(agent, "What is 2 + 3?")
    assert [(c.tool_name, c.tool_kwargs, str(c.tool_output)) for c in result.tool_calls] == [("add", {"a": 2, "b": 3}, "5")]
    assert str(result) == "2 + 3 is 5." and "ToolCallResult" in events
    assert result.raw["qcfuse"]["method"] == "full" and result.raw["qcfuse"]["chunks"] == 0  # no documents: answered


def test_function_agent_calls_a_tool_then_answers(monkeypatch):
    from llama_index.core.agent.workflow import FunctionAgent

    llm = scripted_llm(monkeypatch, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                       "2 + 3 is 5.")
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=add)], llm=llm)
    result, events = run_agent(agent, "What is 2 + 3?")
    assert [(c.tool_name, c.tool_kwargs, str(c.tool_output)) for c in result.tool_calls] == [("add", {"a": 2, "b": 3}, "5")]
    assert str(result) == "2 + 3 is 5." and "ToolCallResult" in events


def test_react_agent_without_tools_or_documents_answers(monkeypatch):
    from llama_index.core.agent.workflow import ReActAgent

    llm = scripted_llm(monkeypatch, "Thought: I can answer without using any tools.\nAnswer: Hi!")
    result, _ = run_agent(ReActAgent(tools=[], llm=llm), "Say hi")
    assert str(result) == "Hi!" and not result.tool_calls
