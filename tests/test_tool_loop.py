"""The tool loop closes and structured output ends (issue 40, items 4 and 5), in each
framework's plain idiom.

Round trips run on a tiny random model with a byte tokenizer whose successive calls are
scripted (the sampler's choices; the engine, the chat template and the parsing run as
usual). A tool result reaches the model in the template's `tool` role (or a user turn where
the template has none), the follow-up is asked without the tool list in a template that
does not know tools, and the answer after the result is text. `predict_and_call`, which
needs a call, decodes one under the tools' schemas. The joke schema of LangChain's standard
tests, on a model that loops inside a string, parses: the repetition guard closes the string.
The embedded model's forced call and text follow-up are the two tests at the end.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from qcfuse_core.engine import generation  # noqa: E402
from qcfuse_core.engine.api import QCFuseEngine  # noqa: E402
from qcfuse_core.model.testing import tiny_model  # noqa: E402
from qcfuse_integrations import chat as turns  # noqa: E402
from qcfuse_integrations.langchain import ChatQCFuse  # noqa: E402
from qcfuse_integrations.llama_index import QCFuseLLM  # noqa: E402

ANY_ROLE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# a template that refuses roles other than system/user/assistant (as Gemma's does)
THREE_ROLES = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
               "{{ raise_exception('unknown role') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL_SPEC = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                            "required": ["a", "b"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
HISTORY = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "content": "5", "tool_call_id": "call_1"}]


def engine(template: str = ANY_ROLE) -> QCFuseEngine:
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = template
    return QCFuseEngine(adapter)


def script(monkeypatch, *replies: str) -> list[str]:
    """Successive calls say `replies` (byte tokens, then the end token); returns the list the
    rendered prompts of the calls are appended to."""
    scripts = iter([list(r.encode()) + [0] for r in replies])
    prompts: list[str] = []
    render = turns.render

    def pick(self, logits):
        if not hasattr(self, "_script"):  # one Sampler per call: the next reply
            self._script = iter(next(scripts))
        return next(self._script)

    def spy(*args, **kwargs):
        prompts.append(render(*args, **kwargs))
        return prompts[-1]

    monkeypatch.setattr(generation.Sampler, "_pick", pick)
    monkeypatch.setattr(turns, "render", spy)
    return prompts


# ---------------------------------------------------------------------- rendering


def test_a_tool_result_goes_back_in_the_tool_role_and_the_follow_up_has_no_tool_list():
    tok = engine().tokenizer
    follow_up = turns.render(tok, HISTORY, [TOOL_SPEC])
    assert "<|tool|>5\n" in follow_up and "<tools>" not in follow_up  # answered: asked in text
    assert '<|assistant|><tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in follow_up
    forced = turns.render(tok, HISTORY, [TOOL_SPEC], forced=True)
    assert "<tools>" in forced  # a forced call after a result still sees the tools
    first = turns.render(tok, HISTORY[:1], [TOOL_SPEC])
    assert "<tools>" in first and first.endswith("<|assistant|>")


def test_a_template_without_a_tool_role_gets_the_result_as_a_user_turn():
    tok = engine(THREE_ROLES).tokenizer
    assert not turns.renders_tool_role(tok)
    assert "<|user|>Result of add: 5\n" in turns.render(tok, HISTORY, [TOOL_SPEC])
    named = [*HISTORY[:2], {"role": "tool", "content": "5", "name": "plus"}]
    assert "<|user|>Result of plus: 5\n" in turns.render(tok, named, [TOOL_SPEC])


def test_a_template_that_knows_tools_renders_everything_itself():
    tok = engine(ANY_ROLE + "{% if tools %}TOOLS:{{ tools | length }}{% endif %}").tokenizer
    out = turns.render(tok, HISTORY, [TOOL_SPEC])
    assert "TOOLS:1" in out and "<|tool|>5" in out and "<tools>" not in out


# ---------------------------------------------------------------------- LangChain


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_langchain_agent_loop_ends_in_text_on_a_scripted_model(monkeypatch):
    """langchain-tests' agent loop: invoke with tools, run the tool, invoke with the history."""
    prompts = script(monkeypatch, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                     "2 + 3 is 5.")
    llm = ChatQCFuse.from_engine(engine(), max_tokens=120).bind_tools([add])
    question = HumanMessage("What is 2 + 3?")
    call = llm.invoke([question])
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("add", {"a": 2, "b": 3})]
    result = add.invoke(call.tool_calls[0])
    answer = llm.invoke([question, call, result])
    assert isinstance(answer, AIMessage) and answer.content == "2 + 3 is 5." and answer.tool_calls == []
    assert "<|tool|>5\n" in prompts[-1] and "<tools>" not in prompts[-1]


def test_langchain_forced_call_then_text(monkeypatch):
    prompts = script(monkeypatch, '{"name": "add", "arguments": {"a": 2, "b": 3}}', "It is 5.")
    llm = ChatQCFuse.from_engine(engine(), max_tokens=120)
    call = llm.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")  # decoded under the schema
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("add", {"a": 2, "b": 3})]
    answer = llm.bind_tools([add]).invoke([HumanMessage("What is 2 + 3?"), call,
                                           ToolMessage("5", tool_call_id=call.tool_calls[0]["id"])])
    assert answer.content == "It is 5." and not answer.tool_calls
    assert "<tools>" in prompts[0] and "<|tool|>5\n" in prompts[1]


# ---------------------------------------------------------------------- LlamaIndex


def ladd(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_llama_index_function_agent_loop_ends_in_text_on_a_scripted_model(monkeypatch):
    from llama_index.core.agent.workflow import FunctionAgent

    prompts = script(monkeypatch, '<tool_call>{"name": "ladd", "arguments": {"a": 2, "b": 3}}</tool_call>',
                     "2 + 3 is 5.")
    llm = QCFuseLLM(engine=engine(), max_new_tokens=200)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=ladd)], llm=llm)

    async def run():
        return await agent.run(user_msg="What is 2 + 3?")

    result = asyncio.run(run())
    assert [(c.tool_name, c.tool_kwargs, str(c.tool_output)) for c in result.tool_calls] == [
        ("ladd", {"a": 2, "b": 3}, "5")]
    assert str(result) == "2 + 3 is 5."
    assert "<|tool|>5\n" in prompts[-1] and "<tools>" not in prompts[-1]


def test_predict_and_call_forces_the_call_it_needs():
    """A random model answers in text when the choice is its own; predict_and_call needs a
    call, so it is decoded under the tool's schema and always parses."""
    llm = QCFuseLLM(engine=engine(), max_new_tokens=60)
    out = llm.predict_and_call([FunctionTool.from_defaults(fn=ladd)], user_msg="What is 2 + 3?")
    assert len(out.sources) == 1 and out.sources[0].tool_name == "ladd"
    kwargs = out.sources[0].raw_input["kwargs"]
    assert set(kwargs) == {"a", "b"} and str(out) == str(kwargs["a"] + kwargs["b"])
    with pytest.raises(ValueError, match="expected a tool call in the response"):
        llm.predict_and_call([FunctionTool.from_defaults(fn=ladd)], user_msg="What is 2 + 3?", tool_required=False)


# ---------------------------------------------------------------------- structured output (item 5)


class Joke(BaseModel):
    """Joke to tell user (langchain-tests' schema)."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


LOOP = "a cat is a cat, and "


@pytest.fixture
def looping(monkeypatch):
    """A model that, inside any string, wants to write LOOP over and over (its second choice:
    the closing quote); outside strings the schema decides. The preference is its logits:
    the real sampler masks and guards them."""
    from qcfuse_core.engine.grammar import RepetitionGuard

    pick = generation.Sampler._pick

    def looping_pick(self, logits):
        where = self.__dict__.setdefault("_where", RepetitionGuard(chr))  # follows the JSON text only
        pref = torch.zeros_like(logits)
        if where.in_string:
            pref[ord(LOOP[len(where.contents.rsplit("\x00", 1)[-1]) % len(LOOP)])] = 10.0
        pref[ord('"')] = 5.0
        token = pick(self, pref)
        where.accept(token)
        return token

    monkeypatch.setattr(generation.Sampler, "_pick", looping_pick)


def test_the_joke_schema_parses_on_a_looping_model(looping):
    chat = ChatQCFuse.from_engine(engine(), max_tokens=200)
    joke = chat.with_structured_output(Joke).invoke("Tell me a joke about cats")
    assert isinstance(joke, Joke) and joke.setup.startswith("a cat is a cat, and a cat")
    assert joke.punchline  # the second field came: the first string ended
    from llama_index.core.prompts import PromptTemplate

    li = QCFuseLLM(engine=engine(), max_new_tokens=200)
    assert isinstance(li.structured_predict(Joke, PromptTemplate("Tell me a joke about {topic}"), topic="cats"), Joke)


def test_without_the_guard_the_looping_model_never_closes_the_string(looping):
    """The same model and schema with the guard off: the budget runs out inside the string."""
    from qcfuse_core.engine.grammar import json_schema_constraint

    eng = engine()
    c = json_schema_constraint(eng.tokenizer, Joke.model_json_schema(), repeat_chars=None)
    r = eng.complete("Tell me a joke about cats", method="full", max_new_tokens=200, constraint=c)
    assert r.finish_reason == "length" and LOOP * 3 in r.text
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_list_items_that_copy_an_earlier_one_are_not_padded_on(looping):
    """A list of strings under maxItems: the looping model's items stop repeating the first."""
    class Tags(BaseModel):
        tags: list[str] = Field(max_length=3)

    chat = ChatQCFuse.from_engine(engine(), max_tokens=200)
    tags = chat.with_structured_output(Tags).invoke("Tag this")
    from qcfuse_core.engine.grammar import REPEAT_CHARS

    first, *rest = tags.tags
    assert 2 <= len(tags.tags) <= 3 and len(first) < len(LOOP) + REPEAT_CHARS
    assert rest and all(len(t) < REPEAT_CHARS for t in rest)  # a copy of the first is cut where it repeats


# ---------------------------------------------------------------------- the embedded model


def test_embedded_model_function_agent_with_a_required_tool_calls_it_then_answers_in_text(tmp_path):
    from llama_index.core.agent.workflow import FunctionAgent

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = QCFuseLLM(store_dir=str(tmp_path), max_new_tokens=40)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=multiply)], llm=llm, initial_tool_choice="multiply")

    async def run():
        return await agent.run(user_msg="What is 12 * 7?")

    result = asyncio.run(run())
    assert [(c.tool_name, c.tool_kwargs, str(c.tool_output)) for c in result.tool_calls] == [
        ("multiply", {"a": 12, "b": 7}, "84")]
    text = str(result)
    assert "<tool_" not in text and "84" in text, text


def test_embedded_model_langchain_forced_call_then_text(tmp_path):
    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = ChatQCFuse(store_dir=str(tmp_path), max_tokens=40)
    question = HumanMessage("What is 12 * 7?")
    call = llm.bind_tools([multiply], tool_choice="any").invoke([question])
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("multiply", {"a": 12, "b": 7})]
    answer = llm.bind_tools([multiply]).invoke([question, call, multiply.invoke(call.tool_calls[0])])
    assert not answer.tool_calls and "<tool_" not in answer.content and "84" in answer.content, answer.content
