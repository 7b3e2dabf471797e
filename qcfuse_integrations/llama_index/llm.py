"""QCFuseLLM: a LlamaIndex `CustomLLM` answering from fused chunk caches.

Drop-in: `index.as_query_engine(llm=QCFuseLLM(store_dir=...))`. Per call:

    1. find     chunk texts inside the prompt: the content index (texts registered at
                ingestion) plus the nodes QCFuseNodePostprocessor recorded for this query
                (a recorded node the index does not know is registered now: computed and
                stored by this call, a hit next time)
    2. frame    completion: the engine wraps the prompt in the model's chat template;
                chat: the messages are rendered with the chat template here
    3. decode   the engine's fused prefill + decode, holding the engine's lock; async calls
                run it in a worker thread that hands text deltas to the event loop through
                an asyncio.Queue
    4. report   the FusionResult's statistics go into the response's `additional_kwargs["qcfuse"]`
                (streams: on a final empty-delta response) and into `last_result`

Chunks are located by content, never trusted by id: a postprocessor id only names a chunk
whose rendered text occurs verbatim in the prompt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Optional

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
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from qcfuse_core.engine import QCFuseEngine, TokenStream
from qcfuse_core.segment import ANCHOR, split_prompt
from qcfuse_core.selectors import SELECTORS
from qcfuse_core.types import FusionResult, Piece
from qcfuse_integrations.engines import engine_lock, shared_engine
from qcfuse_integrations.llama_index.postprocessor import retrieved_nodes

log = logging.getLogger(__name__)

_LAST: ContextVar[tuple[FusionResult, dict[str, Any]] | None] = ContextVar("qcfuse_last_call", default=None)

# Per-call keyword arguments accepted by complete/chat (and their streaming/async forms).
_CALL_KWARGS = ("method", "ratio", "max_new_tokens", "temperature", "stop", "node_ids")


def _check_method(method: str) -> str:
    if method not in SELECTORS:  # read at call time: other modules register selectors
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(SELECTORS))}")
    return method


@dataclass
class _Request:
    """One call, resolved to plain values before any engine work (and before any thread hop)."""

    prompt: str
    chat: bool  # True: `prompt` is already the full chat-template rendering
    explicit: Mapping[str, str]  # {rendered node text: node id} from the postprocessor / caller
    gen: dict[str, Any]  # method, ratio, max_new_tokens, temperature, stop
    chunks: list[Piece] = field(default_factory=list)


class QCFuseLLM(CustomLLM):
    """A local HF decoder answering from query-aware fused KV caches of the retrieved chunks."""

    model: Optional[str] = Field(default=None, description="Packaged model name (smollm2-135m, gemma3-270m) or a local HF model folder (None: the embedded SmolLM2-135M-Instruct).")
    store_dir: Optional[str] = Field(default=None, description="Chunk store folder (None: <cache dir>/store).")
    dtype: Optional[str] = Field(default=None, description="Model dtype, e.g. 'bfloat16', 'float32' (None: default).")
    device: str = Field(default="cpu", description="Device the model runs on.")
    method: str = Field(default="qcfuse", description="Recompute-selection method (qcfuse_core.selectors.SELECTORS).")
    ratio: float = Field(default=0.15, ge=0.0, le=1.0, description="Share of chunk tokens recomputed.")
    max_new_tokens: int = Field(default=128, ge=1, description="Tokens generated at most (LlamaIndex's num_output).")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (not included in the answer).")
    context_window: Optional[int] = Field(default=None, gt=0, description="Prompt budget in tokens (None: the model's max_position_embeddings).")

    _engine: Optional[QCFuseEngine] = PrivateAttr(default=None)

    def __init__(self, *, engine: QCFuseEngine | None = None, **data: Any) -> None:
        """`engine`: use this engine instead of opening one for (store_dir, model, dtype, device)."""
        super().__init__(**data)
        self._engine = engine

    @field_validator("method")
    @classmethod
    def _valid_method(cls, v: str) -> str:
        return _check_method(v)

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseLLM"

    # ------------------------------------------------------------------ engine, metadata
    @property
    def engine(self) -> QCFuseEngine:
        """The process-wide engine for this LLM's store and model (opened on first use)."""
        if self._engine is None:
            self._engine = shared_engine(self.store_dir, model=self.model, dtype=self.dtype, device=self.device)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        adapter = self.engine.adapter
        window = self.context_window or int(getattr(adapter.model.config, "max_position_embeddings", 2048))
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens, model_name=adapter.name,
                           is_chat_model=False)

    @property
    def last_result(self) -> FusionResult | None:
        """The FusionResult of the last call made in this thread / asyncio task."""
        last = _LAST.get()
        return last[0] if last else None

    @property
    def last_stats(self) -> dict[str, Any] | None:
        """The statistics of the last call in this thread / task (as in `additional_kwargs["qcfuse"]`).

        A query engine discards the LLM's response object; this is how its caller sees them.
        """
        last = _LAST.get()
        return last[1] if last else None

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._request(prompt if formatted else self.completion_to_prompt(prompt), False, kwargs)
        deltas, result = self._decode(req)
        return _completion(req, "".join(deltas), "", result)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        req = self._request(prompt if formatted else self.completion_to_prompt(prompt), False, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in self._decode_iter(req):
                if isinstance(delta, FusionResult):
                    yield _completion(req, text, "", delta)
                else:
                    text += delta
                    yield CompletionResponse(text=text, delta=delta)

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._request(prompt if formatted else self.completion_to_prompt(prompt), False, kwargs)
        text = ""
        async for item in self._adecode(req):
            if isinstance(item, FusionResult):
                return _completion(req, text, "", item)
            text += item
        raise AssertionError("decode ended without a result")  # _adecode always ends with one

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        req = self._request(prompt if formatted else self.completion_to_prompt(prompt), False, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in self._adecode(req):
                if isinstance(item, FusionResult):
                    yield _completion(req, text, "", item)
                else:
                    text += item
                    yield CompletionResponse(text=text, delta=item)

        return gen()

    # ------------------------------------------------------------------ chat (model's chat template)
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._request(self._render_chat(messages), True, kwargs)
        deltas, result = self._decode(req)
        return _chat(req, "".join(deltas), "", result)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req = self._request(self._render_chat(messages), True, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for delta in self._decode_iter(req):
                if isinstance(delta, FusionResult):
                    yield _chat(req, text, "", delta)
                else:
                    text += delta
                    yield _chat(req, text, delta, None)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._request(self._render_chat(messages), True, kwargs)
        text = ""
        async for item in self._adecode(req):
            if isinstance(item, FusionResult):
                return _chat(req, text, "", item)
            text += item
        raise AssertionError("decode ended without a result")

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req = self._request(self._render_chat(messages), True, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for item in self._adecode(req):
                if isinstance(item, FusionResult):
                    yield _chat(req, text, "", item)
                else:
                    text += item
                    yield _chat(req, text, item, None)

        return gen()

    def _render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """Messages -> the model's chat template with the assistant turn opened."""
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model {self.engine.adapter.name!r} has no chat template; use complete()")
        rendered = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        if not rendered or messages[-1].role == MessageRole.ASSISTANT:
            raise ValueError("chat needs at least one message, and the last one must not be the assistant's")
        return tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------------ the engine calls
    def _request(self, prompt: str, chat: bool, kwargs: dict[str, Any]) -> _Request:
        """Resolve per-call settings now, in the caller's context (ContextVars do not cross threads)."""
        unknown = set(kwargs) - set(_CALL_KWARGS) - {"formatted"}
        if unknown:
            log.debug("ignoring unsupported keyword arguments: %s", sorted(unknown))
        ratio = self.ratio if kwargs.get("ratio") is None else float(kwargs["ratio"])
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        gen = dict(
            method=_check_method(kwargs.get("method") or self.method),
            ratio=ratio,
            max_new_tokens=int(kwargs.get("max_new_tokens") or self.max_new_tokens),
            temperature=float(self.temperature if kwargs.get("temperature") is None else kwargs["temperature"]),
            stop=tuple(kwargs.get("stop") or self.stop),
        )
        explicit = dict(retrieved_nodes())
        explicit.update(kwargs.get("node_ids") or {})  # {rendered text: node id} given by the caller
        return _Request(prompt, chat, explicit, gen)

    def _open(self, req: _Request) -> TokenStream:
        """1. find + 2. frame (caller holds the engine lock)."""
        engine = self.engine
        req.chunks = find_chunks(engine, req.prompt, req.explicit)
        if not req.chat:
            return engine.stream_complete(req.prompt, req.chunks, **req.gen)
        return engine.stream_pieces(lambda: split_prompt(req.prompt, req.chunks), **req.gen)

    def _decode_iter(self, req: _Request) -> Iterator[str | FusionResult]:
        """Text deltas, then the FusionResult; holds the engine lock throughout."""
        with engine_lock(self.engine):
            stream = self._open(req)
            yield from stream
        assert stream.result is not None
        _remember(req, stream.result)
        yield stream.result

    def _decode(self, req: _Request) -> tuple[list[str], FusionResult]:
        deltas: list[str] = []
        for item in self._decode_iter(req):
            if isinstance(item, FusionResult):
                return deltas, item
            deltas.append(item)
        raise AssertionError("decode ended without a result")

    async def _adecode(self, req: _Request) -> AsyncIterator[str | FusionResult]:
        """`_decode_iter` in a worker thread; deltas reach the event loop through an asyncio.Queue.

        The loop never blocks on the model. If the consumer stops early, the worker stops at
        its next token and releases the engine lock.
        """
        engine = self.engine  # open (load) outside the loop's hot path, but in this thread: cheap when cached
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()

        def post(kind: str, item: Any) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, (kind, item))

        def worker() -> None:
            try:
                with engine_lock(engine):
                    stream = self._open(req)
                    for delta in stream:
                        if cancelled.is_set():
                            return
                        post("delta", delta)
                post("result", stream.result)
            except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
                post("error", exc)

        threading.Thread(target=worker, name="qcfuse-decode", daemon=True).start()
        try:
            while True:
                kind, item = await queue.get()
                if kind == "error":
                    raise item
                if kind == "result":
                    _remember(req, item)
                    yield item
                    return
                yield item
        finally:
            cancelled.set()


# ---------------------------------------------------------------------- content matching


def find_chunks(engine: QCFuseEngine, prompt: str, explicit: Mapping[str, str]) -> list[Piece]:
    """Known chunk texts inside `prompt`, in order, non-overlapping.

    `explicit` ({rendered text: node id}, from the postprocessor) overrides stored ids; a text
    in it that occurs in the prompt but is not in the content index yet (its cache was never
    built) is registered first, so it is found now and its cache is computed and stored by
    this call.
    """
    chunks = engine.texts.find(prompt, node_ids=dict(explicit) or None)
    if explicit:
        found = {c.text for c in chunks}
        missing = [(t, i) for t, i in explicit.items() if t not in found and len(t) >= ANCHOR and t in prompt]
        if missing:
            for text, node_id in missing:
                engine.texts.add(text, node_id)
            log.info("%d retrieved node(s) had no chunk cache; computing and storing them now", len(missing))
            chunks = engine.texts.find(prompt, node_ids=dict(explicit))
    return chunks


# ---------------------------------------------------------------------- responses


def fusion_stats(req: _Request, result: FusionResult) -> dict[str, Any]:
    """The FusionResult's numbers (no answer text) plus which node ids were matched in the prompt."""
    stats = result.to_dict()
    stats.pop("answer", None)
    stats["node_ids"] = [c.node_id for c in req.chunks]
    stats["explicit_ids"] = len(req.explicit)
    return stats


def _remember(req: _Request, result: FusionResult) -> None:
    _LAST.set((result, fusion_stats(req, result)))


def _completion(req: _Request, text: str, delta: str, result: FusionResult) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, additional_kwargs={"qcfuse": fusion_stats(req, result)})


def _chat(req: _Request, text: str, delta: str, result: FusionResult | None) -> ChatResponse:
    extra = {"qcfuse": fusion_stats(req, result)} if result is not None else {}
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                        additional_kwargs=extra)
