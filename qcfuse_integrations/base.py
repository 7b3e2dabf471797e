"""What the LlamaIndex and LangChain integrations share, so the two cannot drift apart.

    EngineBacked        mixin: the `engine` behind a component, from its store_dir / model /
                        dtype / device fields (one engine per store and model per process,
                        engines.py), with the retrieval learner (learning.py) attached
    ENGINE_FIELDS       the descriptions of those four fields (each framework declares them
                        in its own pydantic flavour)
    GenerationOptions   one call's decoding settings under the names users know (max_tokens,
                        temperature, top_p, top_k, repetition_penalty, stop, seed), checked;
                        an unknown keyword raises listing the valid ones
    iterate_in_thread   the async bridge: a blocking iterator (a token stream) run in a
                        worker thread, its items handed to the event loop through a queue

The engine is safe for concurrent callers (everything of one request lives in its
`Request`), so nothing here holds a lock across a generation: two threads or tasks decode
at the same time.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from qcfuse_core.engine import QCFuseEngine
from qcfuse_core.generation import GenerationConfig
from qcfuse_core.selectors import SELECTORS
from qcfuse_integrations.engines import shared_engine

T = TypeVar("T")

ENGINE_FIELDS = {
    "store_dir": "Store folder (kv/, chunk_texts.sqlite, chroma/); None: <cache dir>/store.",
    "model": "Packaged model name (smollm2-135m, gemma3-270m) or a local Hugging Face model folder; "
             "None: the embedded SmolLM2-135M-Instruct.",
    "dtype": "Model dtype: bfloat16 (default), float16 or float32.",
    "device": "torch device of the model, e.g. 'cpu' or 'cuda:0'.",
}

# decoding options every QCFuse model accepts per call, in both frameworks
GENERATION_OPTIONS = ("max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty",
                      "stop", "seed")
FUSION_OPTIONS = ("method", "ratio")


class EngineBacked:
    """Mixin for framework components over a QCFuse engine.

    The component declares `store_dir`, `model`, `dtype`, `device` fields and a private
    `_engine` (None until first use, or an engine handed in); `engine` opens the shared one.
    """

    store_dir: str | None
    model: str | None
    dtype: str | None
    device: str
    _engine: QCFuseEngine | None

    @property
    def engine(self) -> QCFuseEngine:
        """The process-wide engine for this component's store and model (opened on first use)."""
        if self._engine is None:
            self._engine = shared_engine(self.store_dir, model=self.model, dtype=self.dtype, device=self.device)
        return self._engine

    @property
    def learner(self):
        """The engine's retrieval learner (learning.py): which retrieved texts it knows, its counters."""
        from qcfuse_integrations.learning import learner_for

        return learner_for(self.engine)

    def model_name(self) -> str:
        return self.engine.adapter.name


def check_method(method: str) -> str:
    if method not in SELECTORS:  # read at call time: other modules register selectors
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(SELECTORS))}")
    return method


def check_options(kwargs: Mapping[str, Any], valid: Iterable[str], who: str) -> None:
    """Raise TypeError naming the unknown keyword arguments and the valid ones."""
    valid = tuple(valid)
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise TypeError(f"{who} got unknown keyword argument(s) {unknown}; valid: {', '.join(sorted(valid))}")


@dataclass(frozen=True)
class GenerationOptions:
    """One call's fusion and decoding settings: the component's defaults, overridden per call."""

    method: str
    ratio: float
    generation: GenerationConfig
    extra: dict = field(default_factory=dict)

    @classmethod
    def resolve(cls, defaults: Mapping[str, Any], call: Mapping[str, Any]) -> "GenerationOptions":
        """defaults: the component's fields (method, ratio, max_new_tokens, temperature, ...);
        call: the call's keyword arguments (already checked against the valid names), where
        `max_tokens` is a synonym of `max_new_tokens` (the name LangChain and LlamaIndex use)."""
        def get(name: str, default: Any = None) -> Any:
            value = call.get(name)
            return defaults.get(name, default) if value is None else value

        if call.get("max_tokens") is not None and call.get("max_new_tokens") is not None:
            raise TypeError("pass max_tokens or max_new_tokens, not both")
        max_new = call.get("max_tokens")
        if max_new is None:
            max_new = get("max_new_tokens", defaults.get("max_tokens"))
        stop = get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise TypeError(f"stop must be a list of strings, got {type(stop).__name__}")
        ratio = float(get("ratio", 0.15))
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        for name in ("max_new_tokens", "top_k"):
            value = max_new if name == "max_new_tokens" else get("top_k", 0)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        gen = GenerationConfig(
            max_new_tokens=int(max_new if max_new is not None else 64),
            temperature=float(get("temperature", 0.0) or 0.0),
            top_k=int(get("top_k", 0) or 0),
            top_p=float(get("top_p", 1.0) or 1.0),
            repetition_penalty=float(get("repetition_penalty", 1.0) or 1.0),
            stop=tuple(stop),
            seed=get("seed"),
        )
        return cls(check_method(get("method", "qcfuse")), ratio, gen)

    def engine_kwargs(self) -> dict[str, Any]:
        return {"method": self.method, "ratio": self.ratio, "generation": self.generation}


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of `make()` (a blocking iterator) produced in a worker thread, consumed here.

    The event loop never blocks on the model. The worker runs in a copy of the caller's
    context. Closing this generator early (a consumer that stops, a cancelled task) makes the
    worker stop after its current item and close its iterator (so the request ends cleanly).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancel = threading.Event()
    done = asyncio.Event()

    def post(kind: str, item: Any) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, (kind, item))

    def work() -> None:
        try:
            it = make()
            try:
                for item in it:
                    if cancel.is_set():
                        return
                    post("item", item)
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            post("end", None)
        except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
            post("error", exc)
        finally:
            if not loop.is_closed():
                loop.call_soon_threadsafe(done.set)

    ctx = contextvars.copy_context()
    threading.Thread(target=ctx.run, args=(work,), name="qcfuse-decode", daemon=True).start()
    try:
        while True:
            kind, item = await queue.get()
            if kind == "error":
                raise item
            if kind == "end":
                return
            yield item
    finally:
        cancel.set()
        await asyncio.shield(done.wait())


def default_model_name(model: str | None) -> str:
    """The model's name without loading it (tracing metadata asks before the first call)."""
    from pathlib import Path

    from qcfuse_core.model import DEFAULT_MODEL_NAME

    return Path(model).name if model else DEFAULT_MODEL_NAME


@dataclass
class Call:
    """One generation through an integration: the prompt as the framework rendered it, how its
    chunks were matched, and the engine's result once decoding finished. Lives in the call
    (never on the component), so concurrent calls cannot see each other's statistics."""

    prompt: str
    chat: bool  # the prompt is a complete chat-template rendering (no frame is added)
    options: GenerationOptions
    explicit: dict = field(default_factory=dict)  # {text: node id} the caller knows are in the prompt
    chunks: list = field(default_factory=list)
    learned: int = 0
    renderings: list = field(default_factory=list)  # (text, id) re-rendering a stored text (learning.py)
    unmatched: bool = False
    result: Any = None  # FusionResult
    # an explicit chunk channel (LangChain's documents= / doc_ids=): prompt -> chunk pieces,
    # replacing what content matching found
    locate: Callable[[str], list] | None = None

    def stream(self, engine: QCFuseEngine):
        """Match the prompt's chunks (learning.py), then open the engine's token stream."""
        from qcfuse_core.segment import split_prompt
        from qcfuse_integrations.learning import learner_for

        match = learner_for(engine).match(self.prompt, self.explicit)
        self.chunks, self.learned, self.unmatched = match.chunks, match.learned, match.unmatched
        self.renderings = match.renderings
        if self.locate is not None:
            self.chunks = self.locate(self.prompt)
        if self.chat:
            return engine.stream_pieces(lambda: split_prompt(self.prompt, self.chunks), **self.options.engine_kwargs())
        return engine.stream_complete(self.prompt, self.chunks, **self.options.engine_kwargs())

    def deltas(self, engine: QCFuseEngine) -> Iterator[str]:
        """Text deltas; `result` is set once they are exhausted."""
        from qcfuse_integrations.learning import learner_for

        stream = self.stream(engine)
        try:
            yield from stream
        finally:
            stream.close()
        self.result = stream.result
        if self.result is not None and self.result.subspan_tokens and self.renderings:
            learner_for(engine).build(self.renderings)  # served from sub-spans now: whole next time

    def stats(self, engine: QCFuseEngine) -> dict[str, Any]:
        """The FusionResult's numbers (no answer text), which chunks matched, token counts and
        the engine's matching counters (learning.py)."""
        from qcfuse_integrations.learning import learner_for

        r = self.result
        stats = r.to_dict()
        stats.pop("answer", None)
        stats.update(chunk_ids=[c.node_id for c in self.chunks], learned_renderings=self.learned,
                     unmatched=self.unmatched, prompt_tokens=r.prompt_tokens, completion_tokens=len(r.token_ids),
                     total_tokens=r.prompt_tokens + len(r.token_ids),
                     unmatched_prompts=learner_for(engine).counters()["unmatched_prompts"])
        return stats
