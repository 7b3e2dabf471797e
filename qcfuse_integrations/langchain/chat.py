"""ChatQCFuse: a LangChain chat model answering from fused chunk caches.

    llm = ChatQCFuse(store_dir=store)                     # instead of ChatOpenAI(...)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm

Messages go through the model's chat template (system prompt kept). Retrieved documents
reach QCFuse through LangChain's callbacks (retrieval.py): their caches are built in the
background and found inside the rendered prompt by content (learning.py). Per call, as
`invoke(...)` keyword arguments or `bind(...)`:

    max_tokens, temperature, top_p, top_k, repetition_penalty, stop, seed   decoding
    method, ratio                                                           QCFuse's recompute
    tools, tool_choice                        (bind_tools) tool calls through the template
    response_format                           (with_structured_output) JSON-schema
                                              constrained decoding (qcfuse_core/engine/grammar.py)

An unknown keyword raises TypeError listing the valid ones. Each AIMessage carries
`usage_metadata` (prompt tokens as the model saw them, chat frame included) and
`response_metadata` (model name, finish reason and the fusion statistics under "qcfuse");
a stream ends with one empty chunk carrying them.

Async is real: `ainvoke` / `astream` (`_agenerate` / `_astream`) await the engine's async
stream, no thread per call; cancelling the task or closing the stream aborts the request.
`abatch` and `batch` enter the engine's scheduler together (one decode batch): `abatch` is
LangChain's `asyncio.gather` of `ainvoke`s, and `batch` runs `abatch` on an event loop of
its own instead of LangChain's thread pool. The one synchronous step, compiling a JSON
schema for structured output or a forced tool call, runs in `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from operator import itemgetter
from typing import Any, Literal, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    UsageMetadata,
)
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, Field

from qcfuse_integrations import chat as turns
from qcfuse_integrations.base import (
    FUSION_OPTIONS,
    GENERATION_OPTIONS,
    Call,
    EngineBacked,
    GenerationOptions,
    check_options,
    default_model_name,
)
from qcfuse_integrations.langchain.fields import EngineFields

CALL_OPTIONS = (
    *GENERATION_OPTIONS,
    *FUSION_OPTIONS,
    "tools",
    "tool_choice",
    "response_format",
    "ls_structured_output_format",
    "model",
)


class ChatQCFuse(EngineFields, EngineBacked, BaseChatModel):
    """LangChain chat model over a QCFuse engine (one per store folder and model per process)."""

    max_tokens: int | None = Field(
        default=256, ge=1, description="Most tokens generated per answer (also max_new_tokens, num_predict)"
    )
    stop: list[str] | None = Field(default=None, description="Stop strings (cut from the answer)")
    streaming: bool = Field(default=False, description="invoke() streams through the callbacks")
    timeout: float | None = Field(
        default=None, description="Accepted for compatibility; a local model has no request timeout"
    )
    max_retries: int = Field(default=0, ge=0, description="Accepted for compatibility; a local call is not retried")
    api_key: str | None = Field(
        default=None, repr=False, description="Accepted for compatibility; a local model needs no key"
    )
    _token_limit = "max_tokens"

    # ------------------------------------------------------------------ LangChain surface
    @property
    def _llm_type(self) -> str:
        return "qcfuse-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._engine_params(max_tokens=self.max_tokens)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "qcfuse"
        params["ls_model_name"] = kwargs.get("model") or self._model_name()
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        max_tokens = kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_tokens
        if max_tokens:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def _model_name(self) -> str:
        return default_model_name(self.model)  # the folder's name (the embedded model's own name)

    def get_token_ids(self, text: str) -> list[int]:
        """Our model's tokenizer (LangChain's default downloads GPT-2's, which fails offline)."""
        return list(self.engine.tokenizer(text, add_special_tokens=False).input_ids)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Tokens of the rendered conversation, chat template included (what the model sees)."""
        specs = [convert_to_openai_tool(t) for t in tools] if tools else None
        return len(self.get_token_ids(turns.render(self.engine.tokenizer, _to_dicts(messages), specs)))

    # ------------------------------------------------------------------ tools, structured output
    def bind_tools(
        self, tools: Sequence[Any], *, tool_choice: str | dict | bool | None = None, **kwargs: Any
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Tools (functions, pydantic models, BaseTools, JSON schemas) for the model to call.

        tool_choice: "auto" (default) lets the model answer in text or call; "any"/"required"
        forces one call of any tool; a tool name forces that tool. Forced calls are decoded
        under the tools' JSON schema, so they always parse."""
        specs = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            turns.forced_tools(specs, tool_choice)  # an unknown tool name raises now
        return self.bind(tools=specs, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """Answers as `schema` (a pydantic class, TypedDict or JSON schema): the decoder may only
        emit JSON matching it (qcfuse_core/engine/grammar.py), so the answer parses. Every method
        ("json_schema", "function_calling", "json_mode" - the last takes no schema) is served
        by constrained decoding; `strict` is accepted (decoding is always strict)."""
        if kwargs:
            raise TypeError(f"with_structured_output got unknown keyword argument(s) {sorted(kwargs)}")
        valid = ("json_schema", "function_calling", "json_mode")
        if method not in valid:
            raise ValueError(f"unknown method {method!r}; valid: {', '.join(valid)}")
        if method != "json_mode" and schema is None:
            raise ValueError(f"method {method!r} needs a schema")
        json_schema = convert_to_json_schema(schema) if schema is not None and method != "json_mode" else None
        llm = self.bind(
            response_format={"type": "json_schema", "schema": json_schema},
            ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema},
        )
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser = (
            PydanticOutputParser(pydantic_object=cast(type[BaseModel], schema))
            if pydantic and method != "json_mode"
            else JsonOutputParser()
        )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # ------------------------------------------------------------------ generation
    def _call(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        """One call resolved to plain values: (Call, the bound tools, whether a call is forced)."""
        check_options(kwargs, CALL_OPTIONS, "ChatQCFuse")
        tools = kwargs.get("tools") or None
        forced = turns.forced_tools(tools, kwargs.get("tool_choice")) if tools else None
        call_kw = {k: kwargs.get(k) for k in (*GENERATION_OPTIONS, *FUSION_OPTIONS)}
        if stop is not None:
            call_kw["stop"] = stop
        options = GenerationOptions.resolve(self._generation_defaults(self.max_tokens, stop=self.stop), call_kw)
        prompt = turns.render(self.engine.tokenizer, _to_dicts(messages), tools, forced=bool(forced))
        call = Call(prompt, True, options)
        fmt = kwargs.get("response_format")
        if fmt is not None:  # decoded under a JSON schema (compiled when the call is opened)
            if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
                raise ValueError(
                    "response_format must be {'type': 'json_schema', 'schema': {...}} or {'type': 'json_object'}"
                )
            call.constrained, call.schema = True, fmt.get("schema") or (fmt.get("json_schema") or {}).get("schema")
        elif forced:
            call.constrained, call.schema = True, turns.tool_call_schema(forced)
        return call, tools

    def _message(self, call: Call, tools) -> AIMessage:
        text = call.result.text
        content, calls = turns.parse_tool_calls(text, tools) if tools else (text, [])
        return AIMessage(
            content=content,
            tool_calls=[{"name": c.name, "args": c.args, "id": c.id} for c in calls],
            usage_metadata=self._usage(call),
            response_metadata=self._metadata(call),
        )

    def _usage(self, call: Call) -> UsageMetadata:
        n_in, n_out = call.result.prompt_tokens, len(call.result.token_ids)
        return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}

    def _metadata(self, call: Call) -> dict[str, Any]:
        return {
            "model_name": self._model_name(),
            "model_provider": "qcfuse",
            "finish_reason": call.result.finish_reason,
            "qcfuse": call.stats(self.engine),
        }

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import generate_from_stream

            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        call, tools = self._call(messages, stop, kwargs)
        for _ in call.deltas(self.engine):
            pass
        return ChatResult(generations=[ChatGeneration(message=self._message(call, tools))])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call, tools = self._call(messages, stop, kwargs)
        for delta in call.deltas(self.engine):
            if tools:  # a tool call is parsed from the whole answer: it comes in the last chunk
                continue
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(call, tools)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call, tools = self._call(messages, stop, kwargs)
        async with aclosing(call.adeltas(self.engine)) as deltas:  # closed early: the request aborts
            async for delta in deltas:
                if tools:
                    continue
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        yield self._last_chunk(call, tools)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:  # LangChain's agenerate_from_stream would merge in an executor thread
            from langchain_core.language_models.chat_models import generate_from_stream

            chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
            return generate_from_stream(iter(chunks))
        call, tools = self._call(messages, stop, kwargs)
        async for _ in call.adeltas(self.engine):
            pass
        return ChatResult(generations=[ChatGeneration(message=self._message(call, tools))])

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """`abatch` run to completion on an event loop of its own, so the inputs enter the
        engine's scheduler together and are decoded as one batch (LangChain's default runs
        `invoke` per input on a thread pool: the requests arrive one by one, and on a busy
        machine the first may finish before the last is queued). In a thread that already
        runs an event loop, the batch's loop runs in one helper thread."""
        if len(inputs) <= 1:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)

        def run() -> list:
            return asyncio.run(self.abatch(inputs, config, return_exceptions=return_exceptions, **kwargs))

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run()
        context = contextvars.copy_context()  # the caller's tracing context goes along
        with ThreadPoolExecutor(1, thread_name_prefix="qcfuse-batch") as pool:
            return pool.submit(context.run, run).result()

    def _last_chunk(self, call: Call, tools) -> ChatGenerationChunk:
        """The stream's final chunk: usage, metadata and (with tools) the answer and its calls."""
        content, calls = turns.parse_tool_calls(call.result.text, tools) if tools else ("", [])
        chunks = [tool_call_chunk(name=c.name, args=json.dumps(c.args), id=c.id, index=i) for i, c in enumerate(calls)]
        msg = AIMessageChunk(
            content=content,
            tool_call_chunks=chunks,
            usage_metadata=self._usage(call),
            response_metadata=self._metadata(call),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": call.result.finish_reason})


def _to_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages -> OpenAI-style dicts for the chat template."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else _text_of(m.content)
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": content})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": content})
        elif isinstance(m, AIMessage):
            d: dict[str, Any] = {"role": "assistant", "content": content}
            if m.tool_calls:
                d["tool_calls"] = [
                    {"type": "function", "id": c.get("id"), "function": {"name": c["name"], "arguments": c["args"]}}
                    for c in m.tool_calls
                ]
            out.append(d)
        elif isinstance(m, ToolMessage):
            out.append(
                {
                    "role": "tool",
                    "content": content,
                    "tool_call_id": m.tool_call_id,
                    **({"name": m.name} if m.name else {}),
                }
            )
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": content})
        else:
            raise TypeError(f"ChatQCFuse cannot render a {type(m).__name__}")
    return out


def _text_of(blocks: list) -> str:
    """The text of content blocks (tool-call blocks come from `tool_calls`); other kinds
    (images, audio) are refused, not dropped."""
    parts = []
    for b in blocks:
        if isinstance(b, str):
            parts.append(b)
        elif isinstance(b, dict) and b.get("type") == "text":
            parts.append(b.get("text", ""))
        elif isinstance(b, dict) and b.get("type") in ("tool_use", "tool_call"):
            continue  # an assistant's call as a content block: rendered from message.tool_calls
        else:
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise ValueError(f"ChatQCFuse takes text only; got a {kind!r} content block")
    return "".join(parts)
