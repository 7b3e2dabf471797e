"""QCFuseLLM: a LangChain text-completion LLM answering from fused chunk caches.

Drop it into an ordinary chain (`retriever | format_docs | prompt | llm`): the retrieved
documents reach QCFuse through LangChain's callbacks (retrieval.py), their caches are built
in the background, and the texts the chain pastes into the prompt are found by content
(learning.py); only the tokens the method selects are recomputed. Chat-style code should use
`ChatQCFuse` (chat.py). Per call, through `invoke(...)` keyword arguments or `llm.bind(...)`:

    method, ratio                      the recompute method (a name in qcfuse_core.SELECTORS) and budget
    max_tokens (= max_new_tokens),     decoding
    temperature, top_p, top_k,
    repetition_penalty, seed
    documents, doc_ids                 the explicit chunk channel (chunks.py)

An unknown keyword raises TypeError listing the valid ones. Every generation's
`generation_info` carries the fusion statistics (`FusionResult.to_dict()` without the answer)
plus `chunk_ids` and token counts; `llm_output["token_usage"]` sums them. Streaming ends with
one empty chunk carrying them.

Every prompt of a `generate` / `batch` (and `agenerate` / `abatch`) is submitted to the
engine's scheduler before any is read, so the prompts are admitted together and decoded in
one batched step. Async is real: `_astream` / `_agenerate` await the engine's async streams
(no thread per call, the event loop never blocks on the model); cancelling the task or
closing the stream aborts the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import Field

from qcfuse_integrations.base import (
    FUSION_OPTIONS,
    GENERATION_OPTIONS,
    Call,
    EngineBacked,
    GenerationOptions,
    check_options,
    default_model_name,
)
from qcfuse_integrations.langchain.chunks import locate_chunks
from qcfuse_integrations.langchain.fields import EngineFields

CALL_OPTIONS = (*GENERATION_OPTIONS, *FUSION_OPTIONS, "documents", "doc_ids")


class QCFuseLLM(EngineFields, EngineBacked, BaseLLM):
    """LangChain LLM over a QCFuse engine (one per store folder and model per process)."""

    max_new_tokens: int = Field(
        default=64, ge=1, description="Most tokens generated per prompt (also max_tokens, num_predict)"
    )
    _token_limit = "max_new_tokens"

    # ------------------------------------------------------------------ LangChain surface
    @property
    def _llm_type(self) -> str:
        return "qcfuse"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._engine_params(max_new_tokens=self.max_new_tokens)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(
            {
                "ls_provider": "qcfuse",
                "ls_model_name": kwargs.get("model") or self._model_name(),
                "ls_temperature": kwargs.get("temperature", self.temperature),
                "ls_max_tokens": kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_new_tokens,
            }
        )
        return params

    def _model_name(self) -> str:
        return default_model_name(self.model)  # the folder's name (the embedded model's own name)

    def get_token_ids(self, text: str) -> list[int]:
        """Our model's tokenizer (LangChain's default downloads GPT-2's, which fails offline)."""
        return list(self.engine.tokenizer(text, add_special_tokens=False).input_ids)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        calls = [self._call(prompt, stop, kwargs) for prompt in prompts]
        streams = []
        try:
            for call in calls:  # every request queued before any is read: one decode batch
                streams.append(call.open(self.engine))
            for call, stream in zip(calls, streams):
                for _ in call.deltas(self.engine, stream):
                    pass
        finally:
            for stream in streams:  # an error: the others are aborted (no-op once finished)
                stream.close()
        return self._result(calls)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        call = self._call(prompt, stop, kwargs)
        for delta in call.deltas(self.engine):
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=call.stats(self.engine))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        call = self._call(prompt, stop, kwargs)
        async with aclosing(call.adeltas(self.engine)) as deltas:  # closed early: the request aborts
            async for delta in deltas:
                chunk = GenerationChunk(text=delta)
                if run_manager:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        yield GenerationChunk(text="", generation_info=call.stats(self.engine))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        calls = [self._call(prompt, stop, kwargs) for prompt in prompts]
        streams = []
        try:
            for call in calls:  # every request queued before any is read: one decode batch
                streams.append(await call.aopen(self.engine))
            for call, astream in zip(calls, streams):
                async for _ in call.adeltas(self.engine, astream):
                    pass
        finally:
            for astream in streams:  # an error or a cancelled task: the others are aborted
                astream.close()
        return self._result(calls)

    # ------------------------------------------------------------------ internals
    def _call(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> Call:
        check_options(kwargs, CALL_OPTIONS, "QCFuseLLM")
        for name, value, what in (
            ("stop", stop, "strings"),
            ("doc_ids", kwargs.get("doc_ids"), "id strings"),
            ("documents", kwargs.get("documents"), "Documents"),
        ):
            if value is not None and not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list of {what}, got {type(value).__name__}")
        call_kw = {k: kwargs.get(k) for k in (*GENERATION_OPTIONS, *FUSION_OPTIONS)}
        call_kw["stop"] = stop
        options = GenerationOptions.resolve(self._generation_defaults(self.max_new_tokens), call_kw)
        documents, doc_ids = tuple(kwargs.get("documents") or ()), tuple(kwargs.get("doc_ids") or ())
        engine = self.engine

        def explicit(text: str) -> list:  # the explicit chunk channel replaces content matching
            return locate_chunks(engine, text, doc_ids=doc_ids, documents=documents)

        return Call(prompt, False, options, locate=explicit if documents or doc_ids else None)

    def _result(self, calls: list[Call]) -> LLMResult:
        infos = [call.stats(self.engine) for call in calls]
        generations = [[Generation(text=call.result.text, generation_info=info)] for call, info in zip(calls, infos)]
        return LLMResult(generations=generations, llm_output=self._llm_output(infos))

    def _llm_output(self, infos: list[dict]) -> dict[str, Any]:
        usage = {k: sum(i[k] for i in infos) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {
            "model": self.model or "embedded",
            "model_name": self._model_name(),
            "fingerprint": self.engine.caches.fingerprint,
            "token_usage": usage,
        }
