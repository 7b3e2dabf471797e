"""What the LlamaIndex and LangChain integrations share, so the two cannot drift apart.

    EngineBacked        mixin: the `engine` behind a component, from its store_dir / model /
                        dtype / device fields (one engine per store and model per process,
                        engines.py), with the retrieval learner (learning.py) attached
    ENGINE_FIELDS       the descriptions of those four fields (each framework declares them
                        in its own pydantic flavour)
    GenerationOptions   one call's decoding settings under the names users know (max_tokens,
                        temperature, top_p, top_k, repetition_penalty, stop, seed), checked;
                        an unknown keyword raises listing the valid ones
    Call                one generation: the prompt as the framework rendered it, its options,
                        how its chunks were matched and, once decoded, the engine's result;
                        `open` / `deltas` (threads) and `aopen` / `adeltas` (asyncio) are
                        the two ways into the engine's scheduler, one request-building path

The engine is safe for concurrent callers: its scheduler (qcfuse_core/engine/scheduler.py)
owns the device and decodes every running request in one batched step. Nothing here holds
a lock across a generation, and the async methods await the engine's own async streams -
no thread per call - so requests opened together are decoded together.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from qcfuse_core import SELECTORS, AsyncTokenStream, GenerationConfig, QCFuseEngine, TokenStream

if TYPE_CHECKING:
    from pydantic import BaseModel

    from qcfuse_integrations.learning import Match
from qcfuse_integrations.engines import shared_engine

ENGINE_FIELDS = {
    "store_dir": "Store folder (kv/, chunk_texts.sqlite, chroma/); None: <cache dir>/store.",
    "model": "Packaged model name (smollm2-135m, gemma3-270m) or a local Hugging Face model folder; "
    "None: the embedded SmolLM2-135M-Instruct.",
    "dtype": "Model dtype: bfloat16 (default), float16 or float32.",
    "device": "torch device of the model, e.g. 'cpu' or 'cuda:0'.",
}

# decoding options every QCFuse model accepts per call, in both frameworks
GENERATION_OPTIONS = (
    "max_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "stop",
    "seed",
)
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

    def _generation_defaults(self, max_new_tokens: int | None, **more: Any) -> dict[str, Any]:
        """The component's own settings (its fields), for `GenerationOptions.resolve`; the
        token limit is passed in, as each framework names its field its own way."""
        fields = ("method", "ratio", "temperature", "top_p", "top_k", "repetition_penalty", "seed")
        return {**{name: getattr(self, name) for name in fields}, "max_new_tokens": max_new_tokens, **more}


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


TOKEN_LIMIT_NAMES = ("max_tokens", "max_new_tokens", "num_predict")


def constructor_keywords(
    cls: type[BaseModel],
    data: Any,
    *,
    limit: str,
    synonyms: Iterable[str],
    options_dicts: Iterable[str] = (),
    extra: Iterable[str] = (),
) -> Any:
    """A component's constructor keywords, checked and normalised (a pydantic `mode="before"`
    validator calls this with the raw keyword dict).

    limit: the name of the class's token-limit field; synonyms: the other names accepted for
    it (`max_tokens`, `max_new_tokens`, `num_predict`); options_dicts: names of dict
    keywords whose items are generation options (LangChain's `model_kwargs`, LlamaIndex's
    `generate_kwargs`): they are unpacked into the fields; extra: keywords taken by
    `__init__` itself (LlamaIndex's `engine=`). Any other name that is not a field raises
    TypeError listing the valid ones (a typo never passes silently); two spellings of the
    token limit with different values raise too.
    """
    if not isinstance(data, dict):
        return data
    data = dict(data)
    fields = {name for name in cls.model_fields}
    fields |= {f.alias for f in cls.model_fields.values() if isinstance(f.alias, str)}
    for name in options_dicts:
        opts = data.pop(name, None)
        if opts is None:
            continue
        if not isinstance(opts, Mapping):
            raise TypeError(f"{name} must be a dict of generation options, got {type(opts).__name__}")
        settable = sorted(
            {n for n in (*GENERATION_OPTIONS, *FUSION_OPTIONS, *synonyms) if n in fields or n in synonyms}
        )
        check_options(opts, settable, f"{cls.__name__}({name}=...)")
        for key, value in opts.items():
            if key in data and data[key] != value:
                raise TypeError(f"{cls.__name__} got {key} both as a keyword and in {name}")
            data[key] = value
    given = {n: data.pop(n) for n in (limit, *synonyms) if n in data}
    values = {v for v in given.values() if v is not None}
    if len(values) > 1:
        raise TypeError(
            f"{cls.__name__} got different token limits {given}; pass one of {', '.join((limit, *synonyms))}"
        )
    if values:
        data[limit] = values.pop()
    elif limit in given:  # None under the field's own name: the field's own meaning of None
        data[limit] = None
    valid = fields | set(synonyms) | set(options_dicts) | set(extra)
    check_options({k: v for k, v in data.items() if k not in fields}, sorted(valid), cls.__name__)
    return data


@dataclass(frozen=True)
class GenerationOptions:
    """One call's fusion and decoding settings: the component's defaults, overridden per call."""

    method: str
    ratio: float | None  # None: the engine's (EngineConfig.ratio, or what its fidelity target chooses)
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
        ratio = get("ratio", None)
        if ratio is not None:
            ratio = float(ratio)
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


def default_model_name(model: str | None) -> str:
    """The model's name without loading it (tracing metadata asks before the first call)."""
    from pathlib import Path

    from qcfuse_core import DEFAULT_MODEL_NAME

    return Path(model).name if model else DEFAULT_MODEL_NAME


@dataclass
class Call:
    """One generation through an integration: the prompt as the framework rendered it, how its
    chunks were matched, and the engine's result once decoding finished. Lives in the call
    (never on the component), so concurrent calls cannot see each other's statistics.

    Both frameworks build a Call in their sync and async methods alike, then take one of two
    doors into the engine's scheduler:

        threads   open(engine) -> TokenStream        deltas(engine[, stream]) -> Iterator[str]
        asyncio   await aopen(engine) -> AsyncTokenStream
                                                      adeltas(engine[, stream]) -> AsyncIterator[str]

    `open`/`aopen` submit the request at once; calls opened one after another before any is
    read (a LangChain batch) are admitted together and decoded in one batched step.
    """

    prompt: str
    chat: bool  # the prompt is a complete chat-template rendering (no frame is added)
    options: GenerationOptions
    explicit: dict = field(default_factory=dict)  # {text: node id} the caller knows are in the prompt
    chunks: list = field(default_factory=list)
    learned: int = 0
    renderings: list = field(default_factory=list)  # (text, id) re-rendering a stored text (learning.py)
    unmatched: bool = False
    built: int = 0  # matched chunks whose cache a background build made for this request (learning.py)
    build_wait_ms: float = 0.0  # how long matching waited for those builds (inside ttft_ms)
    result: Any = None  # FusionResult
    # an explicit chunk channel (LangChain's documents= / doc_ids=): prompt -> chunk pieces,
    # replacing what content matching found
    locate: Callable[[str], list] | None = None
    # decoding under a JSON schema (structured output, a forced tool call): `schema` (None:
    # any JSON object) is compiled into the request's constraint when the call is opened
    constrained: bool = False
    schema: dict | None = None

    # ------------------------------------------------------------------ threads
    def open(self, engine: QCFuseEngine) -> TokenStream:
        """Submit the request now: the engine's token stream. The prompt's chunks are matched
        first (learning.py), waiting for the background builds of retrieved texts it contains;
        the request's clock starts before that (`started`), so its TTFT includes the wait (as
        queue time)."""
        from qcfuse_integrations.learning import learner_for

        options = self._compiled(engine)
        started = time.perf_counter()
        self._take(learner_for(engine).match(self.prompt, self.explicit))
        return engine.complete(
            self.prompt, self.chunks, framed=not self.chat, stream=True, started=started, **options.engine_kwargs()
        )

    def deltas(self, engine: QCFuseEngine, stream: TokenStream | None = None) -> Generator[str, None, None]:
        """Text deltas (the request is opened at the first unless `stream`, from `open`, is
        given); `result` is set once they are exhausted. Closed early: the request is aborted."""
        stream = self.open(engine) if stream is None else stream
        try:
            yield from stream
        finally:
            stream.close()
        self._finish(engine, stream.result)

    # ------------------------------------------------------------------ asyncio
    async def aopen(self, engine: QCFuseEngine) -> AsyncTokenStream:
        """`open` for asyncio: the request goes straight to the scheduler, its deltas come
        through the event loop's own queue (no thread per call). One step is synchronous
        work: compiling a JSON schema (llguidance walks the tokenizer's vocabulary the first
        time), done with `asyncio.to_thread` so the loop keeps running; unconstrained calls
        never leave the loop. Matching the prompt's chunks runs on the loop, and its wait for
        a background build of a text the prompt contains is awaited (`Learner.amatch`): other
        tasks run meanwhile."""
        from qcfuse_integrations.learning import learner_for

        options = await asyncio.to_thread(self._compiled, engine) if self.constrained else self.options
        started = time.perf_counter()
        self._take(await learner_for(engine).amatch(self.prompt, self.explicit))
        return engine.acomplete(
            self.prompt, self.chunks, framed=not self.chat, stream=True, started=started, **options.engine_kwargs()
        )

    async def adeltas(self, engine: QCFuseEngine, stream: AsyncTokenStream | None = None) -> AsyncGenerator[str, None]:
        """`deltas` for asyncio. Closed early (`aclose`, or its task cancelled): the request is
        aborted and its KV cache freed at the scheduler's next step."""
        stream = await self.aopen(engine) if stream is None else stream
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()
        self._finish(engine, stream.result)

    # ------------------------------------------------------------------ both
    def _take(self, match: Match) -> None:
        """The prompt's chunks as matched (learning.py `Match`, on the caller's thread or event
        loop, before the request is submitted), or as the explicit channel names them."""
        self.chunks, self.learned, self.unmatched = match.chunks, match.learned, match.unmatched
        self.renderings, self.built, self.build_wait_ms = match.renderings, match.built_chunks, match.wait_ms
        if self.locate is not None:
            self.chunks = self.locate(self.prompt)
            self.built = 0  # the explicit channel's chunks: the engine counts them

    def _compiled(self, engine: QCFuseEngine) -> GenerationOptions:
        """The options, with the JSON-schema constraint when the call is constrained."""
        if not self.constrained:
            return self.options
        from qcfuse_core import json_schema_constraint

        gen = replace(self.options.generation, constraint=json_schema_constraint(engine.tokenizer, self.schema))
        return replace(self.options, generation=gen)

    def _finish(self, engine: QCFuseEngine, result: Any) -> None:
        """`result` from the engine's FusionResult, once every delta was read."""
        from qcfuse_integrations.learning import learner_for

        if result is not None and self.built:
            # the engine found these caches stored, but they were built for this request (in the
            # background, since its retrieval): built during it, not hits
            n = min(self.built, result.cache_hits)
            result = replace(
                result,
                cache_hits=result.cache_hits - n,
                cache_misses=result.cache_misses + n,
                cache_built=result.cache_built + n,
            )
        self.result = result
        if self.result is not None and self.result.subspan_tokens and self.renderings:
            learner_for(engine).build(self.renderings)  # served from sub-spans now: whole next time

    def stats(self, engine: QCFuseEngine) -> dict[str, Any]:
        """The FusionResult's numbers (no answer text), which chunks matched, token counts and
        the engine's matching counters (learning.py)."""
        from qcfuse_integrations.learning import learner_for

        r = self.result
        stats = r.to_dict()
        stats.pop("answer", None)
        stats.update(
            chunk_ids=[c.node_id for c in self.chunks],
            learned_renderings=self.learned,
            build_wait_ms=round(self.build_wait_ms, 3),
            unmatched=self.unmatched,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=len(r.token_ids),
            total_tokens=r.prompt_tokens + len(r.token_ids),
            unmatched_prompts=learner_for(engine).counters()["unmatched_prompts"],
        )
        return stats
