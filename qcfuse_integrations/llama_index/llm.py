"""QCFuseLLM: a LlamaIndex chat model answering from fused chunk caches.

Drop-in: `Settings.llm = QCFuseLLM(store_dir=...)`. Per call:

    1. prompt   chat: the messages through the model's chat template (or the user's
                `messages_to_prompt`); completion: the user's `completion_to_prompt`, else
                the engine wraps the prompt in the chat template
    2. find     chunk texts inside the prompt (learning.py): texts registered at ingestion or
                learned from retrievals (retrieval.py: every retriever's nodes are built in
                the background), re-rendered retrieved texts, and the nodes
                QCFuseNodePostprocessor recorded for this query
    3. decode   the engine's fused prefill + decode, in its scheduler (many calls at once
                share decode steps); the async methods (`acomplete`, `astream_complete`,
                `achat`, `astream_chat`) await the engine's async stream - no thread per
                call, so `asyncio.gather` of N calls is decoded as one batch of N
    4. report   the statistics go into every response's `additional_kwargs["qcfuse"]` and
                `raw` (`raw["usage"]`: token counts that TokenCountingHandler reads), so they
                reach the instrumentation's LLM end events too (streams: the last response)

Tools (`chat_with_tools`, `predict_and_call`, agents) go through the chat template
(qcfuse_integrations/chat.py); `structured_predict` / `as_structured_llm` decode under the
output class's JSON schema (qcfuse_core/engine/grammar.py); their async twins compile the
schema with `asyncio.to_thread` (synchronous llguidance work), then decode on the async path
too. Keyword arguments: max_tokens (or max_new_tokens), temperature, top_p, top_k,
repetition_penalty, stop, seed, method, ratio, node_ids; any other raises TypeError listing
these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import aclosing
from typing import Any, Optional, Union

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt

from qcfuse_core import QCFuseEngine
from qcfuse_integrations import chat as turns
from qcfuse_integrations.base import (
    ENGINE_FIELDS,
    FUSION_OPTIONS,
    GENERATION_OPTIONS,
    Call,
    EngineBacked,
    GenerationOptions,
    check_method,
    check_options,
    constructor_keywords,
)
from qcfuse_integrations.llama_index.postprocessor import retrieved_nodes

CALL_OPTIONS = (
    *GENERATION_OPTIONS,
    *FUSION_OPTIONS,
    "node_ids",
    "formatted",
    "tools",
    "tool_choice",
    "response_format",
)


class QCFuseLLM(EngineBacked, FunctionCallingLLM):
    """A local HF decoder answering from query-aware fused KV caches of the retrieved chunks."""

    model: Optional[str] = Field(default=None, description=ENGINE_FIELDS["model"])
    store_dir: Optional[str] = Field(default=None, description=ENGINE_FIELDS["store_dir"])
    dtype: Optional[str] = Field(default=None, description=ENGINE_FIELDS["dtype"])
    device: str = Field(default="cpu", description=ENGINE_FIELDS["device"])
    method: str = Field(default="qcfuse", description="Recompute-selection method (qcfuse_core.SELECTORS).")
    ratio: Optional[float] = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Share of chunk tokens recomputed; None: the engine's, EngineConfig.ratio (0.15) or what its fidelity target chooses.",
    )
    max_new_tokens: int = Field(
        default=128, ge=1, description="Tokens generated at most (LlamaIndex's num_output; call option max_tokens)."
    )
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling; 0 is off.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="HF's repetition penalty; 1 is off.")
    seed: Optional[int] = Field(default=None, description="Sampling seed.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (not included in the answer).")
    context_window: Optional[int] = Field(
        default=None, gt=0, description="Prompt budget in tokens (None: the model's max_position_embeddings)."
    )

    _engine: Optional[QCFuseEngine] = PrivateAttr(default=None)

    def __init__(self, *, engine: QCFuseEngine | None = None, **data: Any) -> None:
        """`engine`: use this engine instead of opening one for (store_dir, model, dtype, device)."""
        from qcfuse_integrations.llama_index.retrieval import install

        super().__init__(**data)
        self._engine = engine
        install()  # retrievals reach the learners from now on

    @model_validator(mode="before")
    @classmethod
    def _keywords(cls, data: Any) -> Any:
        """max_tokens is max_new_tokens; generate_kwargs (HuggingFaceLLM's name) holds
        generation options; an unknown keyword raises TypeError listing the valid ones."""
        return constructor_keywords(
            cls,
            data,
            limit="max_new_tokens",
            synonyms=("max_tokens",),
            options_dicts=("generate_kwargs",),
            extra=("engine",),
        )

    @field_validator("method")
    @classmethod
    def _valid_method(cls, v: str) -> str:
        return check_method(v)

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseLLM"

    @property
    def metadata(self) -> LLMMetadata:
        adapter = self.engine.adapter
        window = self.context_window or int(getattr(adapter.model.config, "max_position_embeddings", 2048))
        chat = bool(getattr(adapter.tokenizer, "chat_template", None))
        return LLMMetadata(
            context_window=window,
            num_output=self.max_new_tokens,
            model_name=adapter.name,
            is_chat_model=chat,
            is_function_calling_model=chat,
        )

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call = self._completion_call(prompt, formatted, kwargs)
        text = "".join(call.deltas(self.engine))
        return self._completion(call, text, "")

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        call = self._completion_call(prompt, formatted, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in call.deltas(self.engine):
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            yield self._completion(call, text, "")

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call = self._completion_call(prompt, formatted, kwargs)
        text = "".join([d async for d in call.adeltas(self.engine)])
        return self._completion(call, text, "")

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        call = self._completion_call(prompt, formatted, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async with aclosing(call.adeltas(self.engine)) as deltas:  # closed early: the request aborts
                async for delta in deltas:
                    text += delta
                    yield CompletionResponse(text=text, delta=delta)
            yield self._completion(call, text, "")

        return gen()

    # ------------------------------------------------------------------ chat (model's chat template)
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call, tools = self._chat_call(messages, kwargs)
        text = "".join(call.deltas(self.engine))
        return self._chat(call, text, "", tools)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        call, tools = self._chat_call(messages, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for delta in call.deltas(self.engine):
                text += delta
                if not tools:
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            yield self._chat(call, text, "", tools)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call, tools = self._chat_call(messages, kwargs)
        text = "".join([d async for d in call.adeltas(self.engine)])
        return self._chat(call, text, "", tools)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        call, tools = self._chat_call(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async with aclosing(call.adeltas(self.engine)) as deltas:  # closed early: the request aborts
                async for delta in deltas:
                    text += delta
                    if not tools:
                        yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            yield self._chat(call, text, "", tools)

        return gen()

    # ------------------------------------------------------------------ tools, structured output
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[list[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg
            )
        specs = [t.metadata.to_openai_tool() for t in tools]
        return {"messages": messages, "tools": specs, "tool_choice": "required" if tool_required else None, **kwargs}

    def predict_and_call(
        self,
        tools: Sequence[Any],
        user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[list[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        error_on_no_tool_call: bool = True,
        error_on_tool_error: bool = False,
        **kwargs: Any,
    ) -> Any:
        """LlamaIndex's predict_and_call; a call that must come (`error_on_no_tool_call`, the
        default) is decoded under the tools' schemas (`tool_required=True` unless given), so
        it comes and parses instead of raising when a model answers in text."""
        kwargs.setdefault("tool_required", error_on_no_tool_call)
        return super().predict_and_call(
            tools,
            user_msg=user_msg,
            chat_history=chat_history,
            verbose=verbose,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            error_on_no_tool_call=error_on_no_tool_call,
            error_on_tool_error=error_on_tool_error,
            **kwargs,
        )

    async def apredict_and_call(
        self,
        tools: Sequence[Any],
        user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[list[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        error_on_no_tool_call: bool = True,
        error_on_tool_error: bool = False,
        **kwargs: Any,
    ) -> Any:
        kwargs.setdefault("tool_required", error_on_no_tool_call)
        return await super().apredict_and_call(
            tools,
            user_msg=user_msg,
            chat_history=chat_history,
            verbose=verbose,
            allow_parallel_tool_calls=allow_parallel_tool_calls,
            error_on_no_tool_call=error_on_no_tool_call,
            error_on_tool_error=error_on_tool_error,
            **kwargs,
        )

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call in the response, got: {response.message.content!r}")
        return [
            ToolSelection(
                tool_id=c["id"], tool_name=c["function"]["name"], tool_kwargs=json.loads(c["function"]["arguments"])
            )
            for c in calls
        ]

    def structured_predict(
        self, output_cls: Any, prompt: Any, llm_kwargs: dict | None = None, **prompt_args: Any
    ) -> Any:
        """`output_cls` from a chat decoded under its JSON schema: the answer always parses."""
        messages = prompt.format_messages(llm=self, **prompt_args)
        schema = output_cls.model_json_schema()
        response = self.chat(messages, response_format={"type": "json_schema", "schema": schema}, **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content)

    async def astructured_predict(
        self, output_cls: Any, prompt: Any, llm_kwargs: dict | None = None, **prompt_args: Any
    ) -> Any:
        messages = prompt.format_messages(llm=self, **prompt_args)
        schema = output_cls.model_json_schema()
        response = await self.achat(
            messages, response_format={"type": "json_schema", "schema": schema}, **(llm_kwargs or {})
        )
        return output_cls.model_validate_json(response.message.content)

    # ------------------------------------------------------------------ the calls
    def _options(self, kwargs: dict[str, Any]) -> GenerationOptions:
        check_options(kwargs, CALL_OPTIONS, "QCFuseLLM")
        defaults = self._generation_defaults(self.max_new_tokens, stop=self.stop)
        return GenerationOptions.resolve(defaults, {k: kwargs.get(k) for k in (*GENERATION_OPTIONS, *FUSION_OPTIONS)})

    def _explicit(self, kwargs: dict[str, Any]) -> dict[str, str]:
        """{rendered node text: node id}: the postprocessor's nodes for this query, the caller's."""
        explicit = dict(retrieved_nodes())
        given = kwargs.get("node_ids") or {}
        if not isinstance(given, Mapping):
            raise TypeError(f"node_ids must be a dict {{rendered node text: node id}}, got {type(given).__name__}")
        explicit.update(given)
        return explicit

    def _completion_call(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> Call:
        options = self._options(kwargs)
        own = self.completion_to_prompt is not default_completion_to_prompt  # the user's template
        if not formatted and own:
            assert self.completion_to_prompt is not None  # LLM's validator sets the default for None
            prompt = self.completion_to_prompt(prompt)
        return Call(prompt, own, options, explicit=self._explicit(kwargs))

    def _chat_call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[Call, list | None]:
        options = self._options(kwargs)
        tools = kwargs.get("tools") or None
        forced = turns.forced_tools(tools, kwargs.get("tool_choice")) if tools else None
        if self.messages_to_prompt is not generic_messages_to_prompt and not tools:  # the user's template
            assert self.messages_to_prompt is not None  # LLM's validator sets the default for None
            prompt = self.messages_to_prompt(messages)
        else:
            prompt = turns.render(self.engine.tokenizer, [_to_dict(m) for m in messages], tools, forced=bool(forced))
        call = Call(prompt, True, options, explicit=self._explicit(kwargs))
        fmt = kwargs.get("response_format")
        if fmt is not None:  # decoded under a JSON schema (compiled when the call is opened)
            call.constrained, call.schema = True, fmt.get("schema")
        elif forced:
            call.constrained, call.schema = True, turns.tool_call_schema(forced)
        return call, tools

    # ------------------------------------------------------------------ responses
    def _raw(self, call: Call) -> dict[str, Any]:
        stats = call.stats(self.engine)
        usage = {k: stats[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {"usage": usage, "qcfuse": stats, "model": self.engine.adapter.name}

    def _completion(self, call: Call, text: str, delta: str) -> CompletionResponse:
        raw = self._raw(call)
        return CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs={"qcfuse": raw["qcfuse"]})

    def _chat(self, call: Call, text: str, delta: str, tools) -> ChatResponse:
        raw = self._raw(call)
        extra: dict[str, Any] = {}
        content = text
        if tools:
            content, calls = turns.parse_tool_calls(text, tools)
            if calls:
                extra["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.args)}}
                    for c in calls
                ]
        message = ChatMessage(role=MessageRole.ASSISTANT, content=content, additional_kwargs=extra)
        return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs={"qcfuse": raw["qcfuse"]})


def _to_dict(m: ChatMessage) -> dict[str, Any]:
    role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
    d: dict[str, Any] = {"role": role, "content": m.content or ""}
    if m.additional_kwargs.get("tool_calls"):
        d["tool_calls"] = m.additional_kwargs["tool_calls"]
    if role == "tool":
        d["tool_call_id"] = m.additional_kwargs.get("tool_call_id")
        if m.additional_kwargs.get("name"):
            d["name"] = m.additional_kwargs["name"]
    return d
