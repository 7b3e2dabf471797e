"""QCFuseEngine: build chunk caches at ingestion; answer from fused caches at query time.

Ingestion (`build_chunks`): token ids -> many chunks prefilled alone per forward pass ->
anchors, probe sidecar and the cache written to the store off the compute thread.

A query runs the pipeline's six steps (pipeline.py): lookup, plan, start loading, select,
fuse, decode - each an engine method with a named, immutable result, chained by `_run` in
one place. Everything is returned in a `FusionResult`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from qcfuse_core.context import check_context
from qcfuse_core.fusion import FusedPrompt, KVCache, Segment, decode_step, fill_from_hf, fused_prefill
from qcfuse_core.generation import GenerationConfig, Sampler, TextAssembler
from qcfuse_core.model import ModelAdapter, load_model
from qcfuse_core.planner import Rates, device_name, load_rates, rates_path
from qcfuse_core.planner import plan as plan_chunks
from qcfuse_core.threads import configure_cpu_threads
from qcfuse_core.pipeline import Loading, LookedUp, Part, Planned, Prefilled, Request, Selected, StageClock
from qcfuse_core.prefetch import ChunkView, Prefetcher
from qcfuse_core.selectors import FIXED_BUDGET_OPTIONS, PROBING_METHODS, SELECTORS, SelectionContext, get_selector
from qcfuse_core.store import ChunkStore, MemoryStore
from qcfuse_core.segment import ChunkTextIndex, split_prompt
from qcfuse_core.subspans import count_chunks, served_tokens
from qcfuse_core.types import ChunkKey, FusionResult, KVChunk, NodeId, Piece, PromptSpan, SelectionResult

log = logging.getLogger(__name__)

# methods that rank by the probed mass with the model's profile (its layers and ranking
# options); the oracle re-ranks by what full prefill knows
PROFILED_METHODS = frozenset({"qcfuse", "adaptive"})

DEFAULT_SYSTEM = "You are a helpful assistant. Answer the question using only the documents provided."


@dataclass(frozen=True)
class EngineConfig:
    method: str = "qcfuse"
    ratio: float = 0.15
    system_prompt: str = DEFAULT_SYSTEM
    context_header: str = "Documents:\n\n"
    glue: str = "\n\n"
    question_template: str = "\n\nQuestion: {question}\nAnswer in one short sentence."
    seed: int = 0
    # CPU intra-op threads for every request (None: qcfuse_core/threads.py's policy - the
    # user's own setting, else torch's default capped at the cores other work leaves idle)
    threads: int | None = None
    # selector options (selectors.QCFuseOptions: critical_layers, anchor_method, anchor_share, budget, ...)
    selection_options: dict = field(default_factory=dict)
    # cache every chunk after the tokenizer's BOS token (dropped from the cache), so that no
    # chunk token was a sequence start, where a model builds its attention sink; the caches
    # still depend on the chunk alone. Another cache format: its keys get their own
    # fingerprint (`QCFuseEngine.fingerprint`), never mixed with plain alone caches. Off by
    # default: on Gemma-3-270M's musique_s it closed 58.5% of naive's gap at 0.3 against
    # 83.1% with plain caches (docs/benchmarks.md, "Chunk caches after a BOS sink")
    chunk_sink: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if "{question}" not in self.question_template:
            raise ValueError("question_template must contain '{question}'")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {self.threads!r}")
        if not isinstance(self.chunk_sink, bool):
            raise ValueError(f"chunk_sink must be True or False, got {self.chunk_sink!r}")


class TokenStream:
    """Iterator over text deltas; `.result` holds the FusionResult once exhausted."""

    def __init__(self, gen: Iterator[str]) -> None:
        self._gen = gen
        self.result: FusionResult | None = None

    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
            raise

    def close(self) -> None:
        """Stop early: the request ends (its state released) without decoding the rest."""
        self._gen.close()


class QCFuseEngine:
    """Ingestion and the request pipeline (qcfuse_core/pipeline.py) over one model and store.

    Shared by many callers: it holds the model, the store and caches that are the same for
    every request (token ids per chunk text, the prefix caches on the compute device, probe
    sidecars in the prefetcher); everything of one request lives in its `Request`.
    """

    def __init__(
        self, adapter: ModelAdapter, store: ChunkStore | None = None, config: EngineConfig | None = None,
        text_index: ChunkTextIndex | None = None, rates: Rates | None = None,
    ) -> None:
        self.adapter = adapter
        self.rates = rates  # measured load/compute rates: enable the load-or-recompute planner
        self.store = store if store is not None else MemoryStore()
        self.texts = text_index if text_index is not None else ChunkTextIndex()
        self._profile = None  # critical_layers.Profile, resolved on first use
        self._opts = None  # (config, its parsed QCFuseOptions)
        # layer-wise loading needs a store that keeps probe sidecars (the tiered store)
        self.prefetcher = Prefetcher(adapter, self.store) if hasattr(self.store, "put_sidecar") else None
        self.config = config or EngineConfig()
        self._sink = _chunk_sink(adapter) if self.config.chunk_sink else None
        # the namespace of this engine's chunk keys: the model's, or its own for sink caches
        self.fingerprint = adapter.fingerprint() if self._sink is None else hashlib.sha256(
            f"{adapter.fingerprint()}|sink={self._sink.tolist()}".encode()).hexdigest()[:16]
        self._head, self._tail = _chat_frame(adapter.tokenizer, self.config.system_prompt)
        self._lock = threading.Lock()  # guards the caches below (dict updates only)
        self._tokens: OrderedDict[str, tuple[torch.Tensor, ChunkKey]] = OrderedDict()  # text -> ids, key
        self._prefixes: OrderedDict[ChunkKey, KVChunk] = OrderedDict()  # on the compute device
        self._linked: OrderedDict[tuple[str, ChunkKey], None] = OrderedDict()
        self._caches: list[KVCache] = []  # fused-prompt caches of finished requests, reused (CUDA)
        configure_cpu_threads(adapter.device, threads=self.config.threads)

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, *, store: ChunkStore | None = None, dtype=None, device: str = "cpu",
        config: EngineConfig | None = None, text_index: ChunkTextIndex | None = None,
    ) -> "QCFuseEngine":
        return cls(load_model(model, dtype=dtype, device=device), store=store, config=config, text_index=text_index)

    @property
    def frame_stops(self) -> tuple[str, ...]:
        """Stop strings the prompt frame calls for: none with a chat template (the model ends
        its turn); with the plain frame of a base model, which has no end of turn and goes on
        writing the frame's next question after its answer, the question line's label
        ("\nQuestion:" for the default `question_template`)."""
        if getattr(self.adapter.tokenizer, "chat_template", None):
            return ()
        label = self.config.question_template.split("{question}")[0].strip()
        return (f"\n{label}",) if label else ()

    @property
    def tokenizer(self):
        if self.adapter.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to the low-level fusion API")
        return self.adapter.tokenizer

    def tokenize(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.int64)

    def chunk_tokens(self, text: str) -> tuple[torch.Tensor, ChunkKey]:
        """Token ids and cache key of a chunk (or prefix) text, tokenised and hashed once."""
        with self._lock:
            got = self._tokens.get(text)
            if got is not None:
                self._tokens.move_to_end(text)
                return got
        ids = self.tokenize(text)
        got = (ids, ChunkKey.for_tokens(self.fingerprint, ids)) if ids.numel() else (ids, None)
        with self._lock:
            self._tokens[text] = got
            while len(self._tokens) > TOKEN_CACHE:
                self._tokens.popitem(last=False)
        return got

    def _link(self, node_id: str | None, key: ChunkKey) -> None:
        """Link a node id to a key once per process (a manifest write, not per request)."""
        if node_id is None:
            return
        with self._lock:
            if (node_id, key) in self._linked:
                return
        self.store.link(NodeId(node_id), key)
        with self._lock:
            self._linked[(node_id, key)] = None
            while len(self._linked) > TOKEN_CACHE:
                self._linked.popitem(last=False)

    # ------------------------------------------------------------------ ingestion
    def prefill_alone(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment alone at positions 0..n-1 -> pre-RoPE k, v (L, n, Hkv, D)."""
        prompt = FusedPrompt([Segment("suffix", ids)])
        cache = KVCache(self.adapter, len(ids))
        out = fused_prefill(self.adapter, prompt, torch.arange(len(ids)), kv_out=cache, capture_pre_rope=True)
        return out.k_pre, cache.v[:, : len(ids)].clone()

    def build_chunks(self, texts: Sequence[str], node_ids: Sequence[str | None] | None = None, *,
                     register: bool = True) -> list[ChunkKey]:
        """Ingestion of many chunks: the caches of those not stored yet are prefilled many per
        forward pass (`ingest.prefill_alone_batch`) and written to the store off the compute
        thread; every text is linked to its node id and registered so `complete` finds it."""
        node_ids = list(node_ids) if node_ids is not None else [None] * len(texts)
        if len(node_ids) != len(texts):
            raise ValueError("node_ids and texts differ in length")
        toks = [self.chunk_tokens(t) for t in texts]
        for t, (ids, _) in zip(texts, toks):
            if ids.numel() == 0:
                raise ValueError(f"cannot cache an empty chunk (text {t[:40]!r})")
        todo: dict[ChunkKey, torch.Tensor] = {}
        for ids, key in toks:
            if key not in todo and not self.store.contains(key):
                todo[key] = ids
        self._build(todo)
        for t, nid, (_, key) in zip(texts, node_ids, toks):
            self._link(nid, key)
            if register:
                self.texts.add(t, nid)
        return [key for _, key in toks]

    def _build(self, todo: dict[ChunkKey, torch.Tensor], *, keep: bool = False) -> dict[ChunkKey, KVChunk]:
        """Prefill and store the chunks in `todo` (key -> ids); keep: return them (with their
        anchors) for this request, else only store them (ingestion holds no batch longer
        than the writer's queue)."""
        from qcfuse_core import ingest

        if not todo:
            return {}
        keys, ids = list(todo), list(todo.values())
        dev = self.adapter.device
        self.critical_layers  # resolve the profile here, not on the writer thread
        built: dict[ChunkKey, KVChunk] = {}
        cuda = dev.type == "cuda"
        if cuda and not keep and hasattr(self.store, "prepare_bulk"):
            sh = self.adapter.shape
            self.store.prepare_bulk([self.store.entry_bytes(k, self.adapter.dtype, sh.num_layers, int(i.numel()),
                                                            sh.num_kv_heads, sh.head_dim) for k, i in zip(keys, ids)],
                                    WRITERS)
        with ingest.StoreWriter(device=dev, synchronous=not cuda, workers=WRITERS,
                                max_pending=2 * WRITERS) as writer:
            for batch in ingest.plan_batches([len(i) for i in ids], ingest.default_batch_tokens(dev)):
                kvs = ingest.prefill_alone_batch(self.adapter, [ids[j] for j in batch], sink=self._sink)
                chunks = [KVChunk(keys[j], ids[j].clone(), k, v) for j, (k, v) in zip(batch, kvs)]
                if keep:
                    for c in chunks:
                        self._add_anchors(c)
                        built[c.key] = c
                for c in chunks:  # one job per chunk: the writers share a batch
                    writer.submit(self._store_chunk, c, not keep)
        return built

    def _store_chunk(self, chunk: KVChunk, bulk: bool = False) -> None:
        """Anchors, cache and probe sidecar of a freshly built chunk (on a writer): the
        sidecar is written once, with the entry. bulk: ingestion (`TieredStore.put`)."""
        self._add_anchors(chunk)
        if self.prefetcher is None:
            self.store.put(chunk)
            return
        anchors, layer_keys = self._probe_sidecar(chunk)
        self.store.put(chunk, anchors=anchors, layer_keys=layer_keys, bulk=bulk)

    def chunk_cache(self, ids: torch.Tensor, node_id: str | None = None) -> tuple[KVChunk, bool]:
        """The in-memory cache of a chunk's exact tokens: (chunk, hit). A miss computes and stores it."""
        if ids.numel() == 0:
            raise ValueError("cannot cache an empty chunk")
        key = ChunkKey.for_tokens(self.fingerprint, ids)
        self._link(node_id, key)
        chunk = self.store.get(key)
        if chunk is not None:
            return chunk, True
        return self._build({key: ids}, keep=True)[key], False

    # -- layer-wise loading (stores with sidecars)
    @property
    def critical_layers(self) -> list[int]:
        """The critical layers the probe reads: selection options, else the model's profile
        (looked up once per engine: the lookup reads files)."""
        from qcfuse_core import critical_layers

        opts = self._qcfuse_options()
        if opts.critical_layers:
            return list(opts.critical_layers)
        if self._profile is None:
            self._profile = critical_layers.resolve(self.adapter)
        return self._profile.layers

    def _probe_sidecar(self, chunk: KVChunk) -> tuple[dict, dict]:
        """What the probe needs of a chunk (anchors + their K/V, critical-layer K)."""
        from qcfuse_core.prefetch import probe_sidecar

        crit = self.critical_layers
        return probe_sidecar(self.adapter, chunk, max(crit) + 1, crit, self._qcfuse_options().anchors)

    def _view(self, key: ChunkKey, ids: torch.Tensor, depth: int):
        from qcfuse_core.prefetch import ensure_sidecar

        crit, anchors = self.critical_layers, self._qcfuse_options().anchors
        try:
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)
        except KeyError:  # stored before sidecars existed (or the sidecar was damaged): make it once
            ensure_sidecar(self.store, self.adapter, key, max(crit) + 1, crit, anchors)
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)

    def _add_anchors(self, chunk: KVChunk) -> None:
        """Ingestion-time anchors for qcfuse (chunk.anchors[method], layers 0..max critical)."""
        from qcfuse_core.anchors import ensure_anchors

        opts = self._qcfuse_options()
        if opts.anchor_method == "repeat" and self.adapter.tokenizer is None:
            return  # repeat anchors need a tokenizer; the selector reports it if asked for
        ensure_anchors(self.adapter, chunk, max(self.critical_layers) + 1, opts.anchors)

    def _qcfuse_options(self):
        """The config's selection options, parsed once per config object."""
        from qcfuse_core.selectors import QCFuseOptions

        if self._opts is None or self._opts[0] is not self.config:  # callers may replace `config`
            self._opts = (self.config, QCFuseOptions.from_options(self.config.selection_options))
        return self._opts[1]

    def build_chunk(self, text: str, node_id: str | None = None) -> ChunkKey:
        """Ingestion of one chunk (see `build_chunks`)."""
        return self.build_chunks([text], [node_id])[0]

    # ------------------------------------------------------------------ prompts
    def rag_pieces(self, question: str, documents: Sequence[str], node_ids: Sequence[str | None] | None = None) -> list[Piece]:
        """The engine's own RAG prompt: [chat head + header][doc][glue][doc]...[question + chat tail]."""
        if not question.strip():
            raise ValueError("question is empty")
        node_ids = list(node_ids) if node_ids is not None else [None] * len(documents)
        if len(node_ids) != len(documents):
            raise ValueError("node_ids and documents differ in length")
        pieces = [Piece("prefix", self._head + self.config.context_header)]
        for i, (doc, nid) in enumerate(zip(documents, node_ids)):
            if i:
                pieces.append(Piece("text", self.config.glue))
            pieces.append(Piece("chunk", doc, nid))
        pieces.append(Piece("suffix", self.config.question_template.format(question=question) + self._tail))
        return pieces

    def completion_pieces(self, prompt: str, chunks: Sequence[Piece] = ()) -> list[Piece]:
        """Wrap a raw completion prompt in the chat frame, split around its known chunk texts
        (`chunks`: Piece("chunk", text, node_id) in order of appearance)."""
        return split_prompt(prompt, chunks, self._head, self._tail)

    def fuse_pieces(self, pieces: Sequence[Piece], *, caches: bool = True) -> tuple[FusedPrompt, int, int]:
        """The fused prompt of `pieces` with every cache in memory -> (prompt, chunk hits,
        misses): steps 1 and 3 without streaming (benchmarks and diagnostics). caches=False
        only tokenizes (full prefill needs no chunk cache)."""
        looked = self.lookup(pieces, "full" if not caches else "naive", streaming=False)
        return self.start_loading(looked, Planned("naive", frozenset())).prompt, looked.hits, looked.misses

    # ------------------------------------------------------------------ the request's steps
    def lookup(self, pieces: Sequence[Piece], method: str, *, streaming: bool | None = None) -> LookedUp:
        """Step 1: tokens per piece, chunk keys and tiers; misses are built and stored now.

        streaming (default: a tiered store and a method other than `full`): chunks stay in
        the store and are streamed by the prefetcher; otherwise they come back in memory."""
        streaming = self._streams(method) if streaming is None else streaming
        caches = method != "full"
        parts: list[Part] = []
        for p in pieces:
            cached = caches and p.kind in ("prefix", "chunk")
            if p.kind in ("prefix", "chunk"):
                ids, key = self.chunk_tokens(p.text)
            elif p.kind == "text" and len(p.text) <= GLUE_CHARS:  # glue between chunks repeats request to request
                ids, key = self.chunk_tokens(p.text)[0], None
            else:
                ids, key = self.tokenize(p.text), None
            if ids.numel() == 0:
                continue
            if not cached:
                parts.append(Part(p.kind, ids, p.node_id))
                continue
            if p.kind != "chunk" or p.source is None:
                self._link(p.node_id, key)
            if p.kind == "prefix":
                chunk, hit = self._prefix(key, ids)
                parts.append(Part("prefix", ids, p.node_id, key, None, chunk, hit))
            elif streaming:
                tier = self.prefetcher.tier_of(key)
                parts.append(Part("chunk", ids, p.node_id, key, tier, None, tier is not None))
            else:
                chunk = self.store.get(key)
                parts.append(Part("chunk", ids, p.node_id, key, "host" if chunk is not None else None, chunk,
                                  chunk is not None))
            if p.kind == "chunk" and p.source is not None:  # a re-rendered text: its runs from the source
                served = None if parts[-1].hit else self._subspans(parts[-1], p.source)
                if served:
                    parts[-1:] = served
                else:
                    self._link(p.node_id, key)
        check_context(self.adapter.max_positions, sum(int(p.ids.numel()) for p in parts))  # before building
        missing = {p.key: p.ids for p in parts if p.kind == "chunk" and p.key is not None and not p.hit}
        built = self._build(missing, keep=True)
        parts = [replace(p, chunk=built[p.key], tier="host") if p.key in built and p.kind == "chunk" else p
                 for p in parts]
        hits, n = count_chunks([p for p in parts if p.kind != "chunk" or p.key is not None], lambda p: p.hit)
        return LookedUp(tuple(parts), hits, n - hits)

    def _subspans(self, part: Part, source: str) -> list[Part] | None:
        """The parts serving a chunk's token runs from the stored cache of the text it
        re-renders (subspans.py); None when that is not stored or shares no run."""
        from qcfuse_core import subspans

        _, src_key = self.chunk_tokens(source)
        stored = self.store.get(src_key) if src_key is not None else None
        served = subspans.serve(part.ids, part.node_id, stored, self.fingerprint) if stored is not None else None
        for p in served or ():
            if p.chunk is not None:
                self._add_anchors(p.chunk)
        return served

    def _prefix(self, key: ChunkKey, ids: torch.Tensor) -> tuple[KVChunk, bool]:
        """The prefix's cache, kept on the compute device between requests (it is exact and
        the same for every request of a prompt template)."""
        with self._lock:
            chunk = self._prefixes.get(key)
            if chunk is not None:
                self._prefixes.move_to_end(key)
                return chunk, True
        chunk = self.store.get(key)
        hit = chunk is not None
        if chunk is None:
            k, v = self.prefill_alone(ids)
            chunk = KVChunk(key, ids.clone(), k, v)
            self.store.put(chunk)
        dev, dt = self.adapter.device, self.adapter.dtype
        chunk = KVChunk(key, chunk.token_ids, chunk.k.to(dev, dt), chunk.v.to(dev, dt))
        with self._lock:
            self._prefixes[key] = chunk
            while len(self._prefixes) > PREFIX_CACHE:
                self._prefixes.popitem(last=False)
        return chunk, hit

    def plan(self, looked: LookedUp, method: str, ratio: float) -> Planned:
        """Step 2: load or recompute each chunk, from measured rates, before any loading.
        Without rates every cached chunk is loaded. A prompt without a chunk cache to
        reuse (a plain chat turn) is answered by full prefill: there is nothing to fuse."""
        if method != "full" and not any(p.key is not None for p in looked.chunks):
            return Planned("full", frozenset())
        if self.rates is None or method == "full" or not looked.chunks:
            return Planned(method, frozenset())
        selector = get_selector(method)
        chunks = looked.chunks
        tiers = [p.tier if p.chunk is None else "host" for p in chunks]  # in memory: as fast as host
        fresh = sum(int(p.ids.numel()) for p in looked.parts if p.kind in ("text", "suffix"))
        overhead = self.rates.select_ms.get(method, self.rates.overhead_ms)
        p = plan_chunks(self.rates, [(int(c.ids.numel()), t) for c, t in zip(chunks, tiers)],
                        ratio=ratio if selector.uses_ratio else 0.0, total_tokens=looked.num_tokens,
                        fresh_rows=fresh, full_layers=2 if method == "cacheblend" else 0,
                        num_layers=self.adapter.num_layers, overhead_ms=overhead)
        return Planned("full" if p.all_recompute else method, frozenset(p.recomputed), p.to_dict())

    def start_loading(self, looked: LookedUp, planned: Planned) -> Loading:
        """Step 3: the fused prompt (sidecars of the loaded chunks for the probe) and, on a
        tiered store, the load session streaming their layers."""
        probe = planned.method in PROBING_METHODS
        depth = max(self.critical_layers) + 1 if probe else 0
        segments, n = [], 0
        for p in looked.parts:
            chunk = p.chunk
            if p.kind == "chunk" and p.key is not None:
                if n in planned.recompute:
                    chunk = None
                elif chunk is None:
                    try:
                        chunk = self._view(p.key, p.ids, depth)
                    except KeyError:  # stored, but unreadable now: a miss, computed again
                        log.warning("chunk %s is unreadable; recomputing its cache", p.key)
                        self.store.delete(p.key)
                        chunk, p = self._build({p.key: p.ids}, keep=True)[p.key], replace(p, hit=False)
                n += 1
            segments.append(Segment(p.kind, p.ids, chunk, p.node_id, p.hit))
        prompt = FusedPrompt(segments)
        lazy = any(isinstance(s.chunk, ChunkView) for s in segments)
        session = self.prefetcher.start(prompt) if lazy else None
        return Loading(prompt, session)

    def select(self, prompt: FusedPrompt, method: str, ratio: float, options: dict | None = None) -> Selected:
        """Step 4: the method's rows. Selection options default to the engine's config; the
        critical layers the engine resolved once are passed on."""
        opts, profile = self._selection_options(method, options)
        sel = get_selector(method).select(SelectionContext(self.adapter, prompt, ratio, seed=self.config.seed,
                                                           options=opts))
        if profile is not None:
            sel.details["layers_source"] = profile.source
        return Selected(sel)

    def selection_options(self, method: str, options: dict | None = None) -> dict:
        """The options `select(prompt, method, ratio, options)` hands the selector: the
        caller's (else the engine's config), the critical layers filled in, and the profile's
        ranking options where those layers come from the profile."""
        return self._selection_options(method, options)[0]

    def _selection_options(self, method: str, options: dict | None):
        opts = dict(self.config.selection_options if options is None else options)
        profile = None  # the model's profile, where the layers filled in come from it
        if method in PROBING_METHODS and opts.get("critical_layers") is None:
            opts["critical_layers"] = self.critical_layers
            profile = None if self._qcfuse_options().critical_layers else self._profile
            if profile is not None and method in PROFILED_METHODS:
                # what the profile calibrated with its layers (critical_layers.PROFILE_OPTIONS);
                # the adaptive budget's calibration counts on the same ranking, less the options
                # only a fixed budget takes (chunk_sinks: tokens placed before any score)
                prof = profile.options
                if method == "adaptive" or opts.get("budget") == "adaptive":
                    prof = {k: v for k, v in prof.items() if k not in FIXED_BUDGET_OPTIONS}
                opts = {**prof, **opts}
        return opts, profile

    def fuse(self, loading: Loading, selected: Selected, method: str, *, capacity: int = 0,
             teacher: torch.Tensor | None = None, request: Request | None = None,
             pieces: Sequence[Piece] | None = None, ratio: float = 0.0) -> Prefilled:
        """Step 5: fused prefill of the prompt (HF's own forward for `full`) into a cache with
        room for `capacity` more tokens. Closes the load session.

        teacher: token ids forced after the prompt (benchmarks): they are recomputed, never
        seen by the selection, and their logits come back too (the last len(teacher) + 1
        rows). A chunk whose layers cannot be read mid-request is deleted and the request is
        fused again from in-memory caches (`pieces` needed), never answered from a hole."""
        prompt, sel = loading.prompt, selected.selection
        T = prompt.num_tokens
        G = 0 if teacher is None else int(teacher.numel())
        if G and loading.session is not None:
            raise ValueError("teacher forcing needs the prompt's caches in memory (lookup with streaming=False)")
        full_prompt = prompt if not G else FusedPrompt(prompt.segments + [Segment("suffix", teacher)])
        cache = self._take_cache(T + G + capacity) if request is not None else KVCache(self.adapter, T + G + capacity)
        if request is not None:
            request.cache = cache
        report: dict = {}
        if method == "full":
            logits, kv = self.adapter.hf_forward(full_prompt.token_ids, keep=G + 1)
            fill_from_hf(cache, kv)
            recomputed = prompt.context_tokens
        else:
            extra = torch.arange(T, T + G)
            rows = torch.cat([sel.rows, extra]) if G else sel.rows
            hook = sel.on_layer_end
            if G and hook is not None:  # rows it narrows to are the prompt's: keep the teacher's
                def hook(state, _inner=sel.on_layer_end):
                    nxt = _inner(state)
                    return None if nxt is None else torch.cat([nxt.cpu(), extra])
            session = loading.session
            try:
                out = fused_prefill(self.adapter, full_prompt, rows, full_layers=sel.full_layers, on_layer_end=hook,
                                    kv_out=cache, source=session, logits_last=G + 1)
                if session is not None:
                    rep = session.finish()
                    report = rep.to_dict()
                    if request is not None:
                        request.extra["load_wait_ms"] = rep.total_wait_ms
            finally:
                if session is not None:
                    session.close()
            if report.get("failed"):
                return self._recover(prompt, report, method, capacity, teacher, request, pieces, ratio)
            logits, rows = out.logits, out.rows
            recomputed = _context_rows(prompt, rows[rows < T])
            sel.details.setdefault("layer_ms", out.layer_ms)
            sel.details.setdefault("row_sets", out.row_sets)
        cache.length = T
        hits, n_chunks = count_chunks([s for s in prompt.segments if s.kind != "chunk" or s.chunk is not None or s.cache_hit],
                                      lambda s: s.cache_hit)
        return Prefilled(logits, cache, prompt, sel, recomputed, hits, n_chunks - hits, report)

    def _take_cache(self, n: int) -> KVCache:
        """A fused-prompt cache with room for `n` tokens: the one a finished request gave back
        when it fits (allocating gigabytes per request costs the allocator's time)."""
        with self._lock:
            for i, c in enumerate(self._caches):
                if n <= c.capacity <= 2 * n:
                    c.length = 0
                    return self._caches.pop(i)
        return KVCache(self.adapter, n)

    def _give_cache(self, cache: KVCache | None) -> None:
        if cache is None or self.adapter.device.type != "cuda":  # on a CPU the allocator is cheap
            return
        with self._lock:
            self._caches = [cache] + self._caches[: KV_POOL - 1]

    def _recover(self, prompt, report, method, capacity, teacher, request, pieces, ratio) -> Prefilled:
        log.warning("%d chunk cache(s) unreadable mid-request; recomputing them", len(report["failed"]))
        if pieces is None:
            raise RuntimeError("a chunk cache could not be read and the request cannot be rebuilt")
        for i in report["failed"]:  # segment indices
            self.store.delete(prompt.segments[i].chunk.key)
            if self.prefetcher is not None:
                self.prefetcher.forget_sidecars()
        looked = self.lookup(pieces, method, streaming=False)  # the deleted ones are misses now
        loading = self.start_loading(looked, Planned(method, frozenset()))
        selected = self.select(loading.prompt, method, ratio)
        out = self.fuse(loading, selected, method, capacity=capacity, teacher=teacher, request=request)
        return replace(out, load_report=report)

    def decode(self, pre: Prefilled, request: Request) -> Iterator[str]:
        """Step 6: the first token (TTFT is taken here), then decoding from the fused cache;
        returns the FusionResult."""
        gen, clock = request.generation, request.clock
        eos = self._eos_ids()
        sampler = Sampler(gen, prompt=pre.prompt.token_ids, eos=sorted(eos))
        assembler = TextAssembler(self.tokenizer, gen.stop)
        token = sampler(pre.logits[-1])
        clock.mark("first_token")
        ttft = clock.since_start_ms()
        ids: list[int] = []
        finish = "length"
        while True:
            if token in eos:
                finish = "stop"
                break
            ids.append(token)
            delta = assembler.push(token)
            if delta:
                yield delta
            if assembler.stopped:
                finish = "stop"
                break
            if len(ids) >= gen.max_new_tokens:
                break
            token = sampler(decode_step(self.adapter, pre.cache, token))
        tail = assembler.finish()
        if tail:
            yield tail
        selector = get_selector(pre.selection.method) if pre.selection.method in SELECTORS else None
        prompt = pre.prompt
        return FusionResult(
            text=assembler.text, token_ids=ids, method=request.method,
            ratio=request.ratio if selector is not None and selector.uses_ratio else None, ttft_ms=ttft,
            total_ms=clock.since_start_ms(), context_tokens=prompt.context_tokens, prompt_tokens=prompt.num_tokens,
            recomputed_tokens=pre.recomputed_tokens, cache_hits=pre.hits, cache_misses=pre.misses,
            chunks=count_chunks(prompt.segments, lambda s: s.cache_hit)[1], finish_reason=finish, timings_ms={**clock.stages, **request.extra},
            selection=pre.selection, store_stats=_counters(self.store), plan=request.plan,
            load=pre.load_report, threads=request.threads, prompt_ids=prompt.token_ids,
            spans=tuple(PromptSpan(s.kind, st, st + len(s), s.node_id, s.cache_hit)
                        for s, st in zip(prompt.segments, prompt.starts)),
            subspan_tokens=served_tokens(prompt.segments),
        )

    # ------------------------------------------------------------------ answering
    def answer(self, question: str, documents: Sequence[str], **kw) -> FusionResult:
        stream = self.stream(question, documents, **kw)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self, question: str, documents: Sequence[str], *, node_ids=None, method: str | None = None,
        ratio: float | None = None, generation: GenerationConfig | None = None, sync_stages: bool = False,
        **gen_kw,
    ) -> TokenStream:
        return self.stream_pieces(lambda: self.rag_pieces(question, documents, node_ids), method=method,
                                  ratio=ratio, generation=generation, sync_stages=sync_stages, **gen_kw)

    def complete(self, prompt: str, chunks: Sequence[Piece] | None = None, **kw) -> FusionResult:
        """Answer a raw completion prompt; known chunk texts inside it are found by content."""
        stream = self.stream_complete(prompt, chunks, **kw)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream_complete(self, prompt: str, chunks: Sequence[Piece] | None = None, **kw) -> TokenStream:
        if chunks is None:
            chunks = self.texts.find(prompt)
        return self.stream_pieces(lambda: self.completion_pieces(prompt, chunks), **kw)

    def stream_pieces(self, make_pieces, *, method: str | None = None, ratio: float | None = None,
                      generation: GenerationConfig | None = None, sync_stages: bool = False, **gen_kw) -> TokenStream:
        method = method or self.config.method
        if method not in SELECTORS:
            raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(SELECTORS))}")
        ratio = self.config.ratio if ratio is None else ratio
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        gen = generation or GenerationConfig()
        if gen_kw:
            gen = replace(gen, **gen_kw)
        return TokenStream(self._run(make_pieces, method, ratio, gen, sync_stages))

    def _run(self, make_pieces, method: str, ratio: float, gen: GenerationConfig, sync_stages: bool) -> Iterator[str]:
        """The request: steps 1-6 (pipeline.py), its state in a `Request` closed in `finally`."""
        # CPU threads are chosen per request, in the request's thread (a machine's load changes)
        threads = configure_cpu_threads(self.adapter.device, threads=self.config.threads)["threads"]
        req = Request(method, ratio, gen, StageClock(self.adapter.device, sync_stages))
        req.threads = threads
        try:
            pieces = make_pieces()
            looked = self.lookup(pieces, method)
            check_context(self.adapter.max_positions, looked.num_tokens, gen.max_new_tokens)
            req.clock.mark("lookup")
            planned = self.plan(looked, method, ratio)
            req.method, req.plan = planned.method, planned.plan
            req.clock.mark("plan")
            loading = self.start_loading(looked, planned)
            req.session = loading.session
            req.clock.mark("load_start")
            selected = self.select(loading.prompt, req.method, ratio)
            req.clock.mark("select")
            pre = self.fuse(loading, selected, req.method, capacity=gen.max_new_tokens, request=req,
                            pieces=pieces, ratio=ratio)
            req.clock.mark("prefill")
            return (yield from self.decode(pre, req))
        finally:
            req.close()
            self._give_cache(req.cache)

    def _streams(self, method: str) -> bool:
        return self.prefetcher is not None and method != "full"

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.adapter.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(i) for i in src)
        return ids


GLUE_CHARS = 256  # text pieces up to this long (separators, headers) are tokenised once, like chunks
TOKEN_CACHE = 8192  # chunk texts whose token ids and keys are kept (about 8 KB each at 1K tokens)
PREFIX_CACHE = 8  # prefix caches kept on the compute device (prompt templates)
KV_POOL = 1  # fused-prompt caches kept for the next request (CUDA)
WRITERS = 8  # store-writer threads of ingestion on CUDA (a write is mostly waiting: pinning, copies, file)


def _counters(store) -> dict:
    """The store's counters without touching its index (no SQLite query per answer)."""
    fn = getattr(store, "counters", None)
    return fn() if fn is not None else store.stats()


def _context_rows(prompt: FusedPrompt, rows: torch.Tensor) -> int:
    return int(prompt.mask("chunk", "text")[rows].sum())


def _chunk_sink(adapter: ModelAdapter) -> torch.Tensor:
    """The token ids chunks are cached after with `EngineConfig.chunk_sink`: the BOS token."""
    bos = getattr(adapter.tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError(f"chunk_sink caches chunks after the tokenizer's BOS token, and {adapter.name} has "
                         "none; use chunk_sink=False")
    return torch.tensor([int(bos)], dtype=torch.int64)


def _chat_frame(tokenizer, system: str) -> tuple[str, str]:
    """(head, tail) of the model's chat template around one user message. Without one (a base
    model, e.g. Gemma-3-270M) the plain frame: [BOS where the tokenizer starts every text
    with it] + system + blank line ... question + a new line "Answer:", the cue a base model
    completes (without it Gemma-3-270M repeats the instruction line). The engine tokenizes
    pieces without special tokens, so a base model's BOS is written here."""
    if tokenizer is None:
        return "", ""
    if not getattr(tokenizer, "chat_template", None):
        bos = getattr(tokenizer, "bos_token", None)
        starts = bos is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
        return (bos if starts else "") + (system + "\n\n" if system else ""), "\nAnswer:"
    sentinel = "\x00QCFUSE-USER\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": sentinel}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, _, tail = rendered.partition(sentinel)
    return head, tail


__all__ = ["EngineConfig", "Piece", "QCFuseEngine", "SelectionResult", "TokenStream"]


def open_engine(
    store_dir: str | Path | None = None, *, model: str | None = None, dtype=None, device: str = "cpu",
    config: EngineConfig | None = None, memory_bytes: int | None = None, read_only: bool | None = None,
) -> QCFuseEngine:
    """An engine over a persistent store folder (default: <cache dir>/store).

    Layout of `store_dir`: kv/ (chunk caches), chunk_texts.sqlite (content index), chroma/
    (the vector store, used by the CLI and integrations), rates-*.json (measured by `qcfuse
    bench ttft --store DIR`; with them the planner decides load vs recompute per chunk).
    Models are loaded once per process. read_only: None opens the store read-only when it
    is not writable; True never writes to it (answers from what is stored).
    """
    from qcfuse_core.model import cache_dir
    from qcfuse_core.store import kv_dir, open_store, writable

    root = Path(store_dir) if store_dir is not None else cache_dir() / "store"
    if not read_only and writable(root):
        root.mkdir(parents=True, exist_ok=True)
    key = (str(model), str(dtype), device)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = load_model(model, dtype=dtype, device=device)
    store_kw = {} if memory_bytes is None else {"memory_bytes": memory_bytes}
    store = open_store(kv_dir(root), read_only=read_only, **store_kw)
    adapter = _ADAPTERS[key]
    rates = load_rates(rates_path(root, adapter.fingerprint(), device_name(adapter.device)))
    return QCFuseEngine(adapter, store=store, config=config,
                        text_index=ChunkTextIndex(root / "chunk_texts.sqlite", read_only=store.disk.read_only),
                        rates=rates)


_ADAPTERS: dict[tuple[str, str, str], ModelAdapter] = {}
