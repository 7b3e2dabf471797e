"""QCFuseLLM: a LangChain text-completion LLM answering from fused chunk caches.

Drop it into an ordinary chain (`retriever | format_docs | prompt | llm`): the chunk texts
the chain pastes into the prompt are found by content (chunks.py), their caches fused, and
only the tokens the method selects are recomputed. Per call, through `invoke(...)` keyword
arguments or `llm.bind(...)`:

    method, ratio                      the recompute method (qcfuse_core.selectors) and budget
    max_new_tokens, temperature,       decoding
    top_p, top_k, seed
    documents, doc_ids                 the explicit chunk channel (chunks.py)

Every generation's `generation_info` carries the fusion statistics (`FusionResult.to_dict()`
without the answer) plus `chunk_ids`. Streaming ends with one empty chunk carrying them.

Async is real: `_astream` / `_agenerate` decode in a worker thread that feeds an
asyncio.Queue, so the event loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import Field, PrivateAttr

from qcfuse_core.engine import QCFuseEngine, TokenStream
from qcfuse_core.types import FusionResult, Piece
from qcfuse_integrations.langchain.chunks import locate_chunks
from qcfuse_integrations.engines import engine_lock, shared_engine

_GENERATION_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
CALL_OPTIONS = ("method", "ratio", *_GENERATION_KEYS, "documents", "doc_ids")


@dataclass(frozen=True)
class CallOptions:
    """One call's settings: the LLM's fields overridden by the call's keyword arguments."""

    method: str
    ratio: float
    generation: dict[str, Any]
    stop: tuple[str, ...] = ()
    documents: tuple = ()
    doc_ids: tuple[str, ...] = ()


class QCFuseLLM(BaseLLM):
    """LangChain LLM over a QCFuse engine (one per store folder and model per process)."""

    store_dir: str | None = Field(
        default=None, description="Store folder (kv/, chunk_texts.sqlite, chroma/); None: <cache dir>/store")
    model: str | None = Field(default=None, description="Packaged model name (smollm2-135m, gemma3-270m) or a local Hugging Face model folder; None: the embedded model")
    dtype: str | None = Field(default=None, description="bf16 (default), fp16 or fp32")
    device: str = Field(default="cpu", description="torch device of the model")
    method: str = Field(default="qcfuse", description="Recompute method, a name in qcfuse_core.selectors.SELECTORS")
    ratio: float = Field(default=0.15, ge=0.0, le=1.0, description="Share of context tokens recomputed")
    max_new_tokens: int = Field(default=64, ge=1, description="Most tokens generated per prompt")
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass")
    top_k: int = Field(default=0, ge=0, description="0: off")
    seed: int | None = Field(default=None, description="Sampling seed")

    _engine: QCFuseEngine | None = PrivateAttr(default=None)

    @classmethod
    def from_engine(cls, engine: QCFuseEngine, **fields: Any) -> "QCFuseLLM":
        """An LLM over an engine built by hand (tests, a custom store)."""
        llm = cls(**fields)
        llm._engine = engine
        return llm

    @property
    def engine(self) -> QCFuseEngine:
        if self._engine is None:
            self._engine = shared_engine(self.store_dir, model=self.model, dtype=self.dtype, device=self.device)
        return self._engine

    # ------------------------------------------------------------------ LangChain surface
    @property
    def _llm_type(self) -> str:
        return "qcfuse"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model or "embedded", "dtype": self.dtype, "device": self.device,
            "store_dir": self.store_dir, "method": self.method, "ratio": self.ratio,
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
        }

    def get_token_ids(self, text: str) -> list[int]:
        """Our model's tokenizer (LangChain's default downloads GPT-2's, which fails offline)."""
        return list(self.engine.tokenizer(text, add_special_tokens=False).input_ids)

    def _generate(
        self, prompts: list[str], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> LLMResult:
        opts = self._options(stop, kwargs)
        generations = []
        for prompt in prompts:  # one engine, one generation at a time
            with self._generation(prompt, opts) as (stream, chunks):
                for _ in stream:
                    pass
            generations.append([Generation(text=stream.result.text, generation_info=_info(stream.result, chunks))])
        return LLMResult(generations=generations, llm_output=self._llm_output())

    def _stream(
        self, prompt: str, stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        opts = self._options(stop, kwargs)
        with self._generation(prompt, opts) as (stream, chunks):
            for delta in stream:
                chunk = GenerationChunk(text=delta)
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        yield GenerationChunk(text="", generation_info=_info(stream.result, chunks))

    async def _astream(
        self, prompt: str, stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        opts = self._options(stop, kwargs)
        async for delta, info in self._decode_in_thread(prompt, opts):
            if info is not None:
                yield GenerationChunk(text="", generation_info=info)
                return
            chunk = GenerationChunk(text=delta)
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk

    async def _agenerate(
        self, prompts: list[str], stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> LLMResult:
        opts = self._options(stop, kwargs)
        generations = []
        for prompt in prompts:
            parts, info = [], None
            async for delta, info in self._decode_in_thread(prompt, opts):
                if info is None:
                    parts.append(delta)
            generations.append([Generation(text="".join(parts), generation_info=info)])
        return LLMResult(generations=generations, llm_output=self._llm_output())

    # ------------------------------------------------------------------ internals
    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> CallOptions:
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise TypeError(f"QCFuseLLM got unknown call options {unknown}; valid: {', '.join(CALL_OPTIONS)}")
        get = lambda name: kwargs[name] if kwargs.get(name) is not None else getattr(self, name)  # noqa: E731
        for name, value, what in (("stop", stop, "strings"), ("doc_ids", kwargs.get("doc_ids"), "id strings"),
                                   ("documents", kwargs.get("documents"), "Documents")):
            if value is not None and not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list of {what}, got {type(value).__name__}")
        return CallOptions(
            method=get("method"), ratio=get("ratio"), generation={k: get(k) for k in _GENERATION_KEYS},
            stop=tuple(stop or ()), documents=tuple(kwargs.get("documents") or ()),
            doc_ids=tuple(kwargs.get("doc_ids") or ()),
        )

    @contextmanager
    def _generation(self, prompt: str, opts: CallOptions) -> Iterator[tuple[TokenStream, list[Piece]]]:
        """Hold the engine for one prompt: locate its chunks, start decoding, yield the stream."""
        engine = self.engine
        with engine_lock(engine):
            chunks = locate_chunks(engine, prompt, doc_ids=opts.doc_ids, documents=opts.documents)
            stream = engine.stream_complete(prompt, chunks, method=opts.method, ratio=opts.ratio,
                                            stop=opts.stop, **opts.generation)
            yield stream, chunks

    async def _decode_in_thread(self, prompt: str, opts: CallOptions) -> AsyncIterator[tuple[str, dict | None]]:
        """Decode in a worker thread; yield (delta, None) per text delta, then ("", info) once.

        Closing this generator early (a consumer that stops, a cancelled task) tells the
        worker to stop after its current token, and waits for it to let go of the engine.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def post(kind: str, item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, item))

        def work() -> None:
            try:
                with self._generation(prompt, opts) as (stream, chunks):
                    for delta in stream:
                        if cancel.is_set():
                            return
                        post("delta", delta)
                post("done", _info(stream.result, chunks))
            except Exception as exc:  # handed to the consumer, which re-raises it
                post("error", exc)

        worker = loop.run_in_executor(None, work)
        try:
            while True:
                kind, item = await queue.get()
                if kind == "error":
                    raise item
                if kind == "done":
                    yield "", item
                    return
                yield item, None
        finally:
            cancel.set()
            await asyncio.shield(worker)

    def _llm_output(self) -> dict[str, Any]:
        return {"model": self.model or "embedded", "fingerprint": self.engine.fingerprint}


def _info(result: FusionResult | None, chunks: Sequence[Piece]) -> dict[str, Any]:
    assert result is not None, "the token stream was not exhausted"
    info = result.to_dict()
    info.pop("answer")
    info["chunk_ids"] = [c.node_id for c in chunks]
    return info
