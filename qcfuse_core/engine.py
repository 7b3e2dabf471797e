"""QCFuseEngine: build chunk caches at ingestion; answer from fused caches at query time.

Per query, in order:

    1. lookup    tokenize prefix / chunks / glue / suffix piece by piece; fetch each chunk's
                 cache by content key (compute and store it on a miss)
    2. select    the method picks the rows to recompute (selectors.py)
    3. fuse      layer-wise fused prefill (fusion.py); `full` runs HF's own forward instead
    4. decode    sample the first token (TTFT is taken here), then decode from the fused cache

Everything is returned in a `FusionResult`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from qcfuse_core.fusion import FusedPrompt, KVCache, Segment, decode_step, fill_from_hf, fused_prefill
from qcfuse_core.generation import GenerationConfig, Sampler, TextAssembler
from qcfuse_core.model import ModelAdapter, load_model
from qcfuse_core.planner import Rates, device_name, load_rates, rates_path
from qcfuse_core.planner import plan as plan_chunks
from qcfuse_core.prefetch import Prefetcher
from qcfuse_core.selectors import SELECTORS, SelectionContext, get_selector
from qcfuse_core.store import ChunkStore, MemoryStore
from qcfuse_core.segment import ChunkTextIndex, split_prompt
from qcfuse_core.types import ChunkKey, FusionResult, KVChunk, NodeId, Piece, SelectionResult

log = logging.getLogger(__name__)

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
    # selector options (selectors.QCFuseOptions: critical_layers, anchor_method, anchor_share, budget, ...)
    selection_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if "{question}" not in self.question_template:
            raise ValueError("question_template must contain '{question}'")


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


class QCFuseEngine:
    def __init__(
        self, adapter: ModelAdapter, store: ChunkStore | None = None, config: EngineConfig | None = None,
        text_index: ChunkTextIndex | None = None, rates: Rates | None = None,
    ) -> None:
        self.adapter = adapter
        self.rates = rates  # measured load/compute rates: enable the load-or-recompute planner
        self.store = store if store is not None else MemoryStore()
        self.texts = text_index if text_index is not None else ChunkTextIndex()
        self._critical: list[int] | None = None
        # layer-wise loading needs a store that keeps probe sidecars (the tiered store)
        self.prefetcher = Prefetcher(adapter, self.store) if hasattr(self.store, "put_sidecar") else None
        self.config = config or EngineConfig()
        self.fingerprint = adapter.fingerprint()
        self._head, self._tail = _chat_frame(adapter.tokenizer, self.config.system_prompt)

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, *, store: ChunkStore | None = None, dtype=None, device: str = "cpu",
        config: EngineConfig | None = None, text_index: ChunkTextIndex | None = None,
    ) -> "QCFuseEngine":
        return cls(load_model(model, dtype=dtype, device=device), store=store, config=config, text_index=text_index)

    @property
    def tokenizer(self):
        if self.adapter.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to the low-level fusion API")
        return self.adapter.tokenizer

    def tokenize(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.int64)

    # ------------------------------------------------------------------ ingestion
    def prefill_alone(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment alone at positions 0..n-1 -> pre-RoPE k, v (L, n, Hkv, D)."""
        prompt = FusedPrompt([Segment("suffix", ids)])
        cache = KVCache(self.adapter, len(ids))
        out = fused_prefill(self.adapter, prompt, torch.arange(len(ids)), kv_out=cache, capture_pre_rope=True)
        return out.k_pre, cache.v[:, : len(ids)].clone()

    def chunk_cache(self, ids: torch.Tensor, node_id: str | None = None, *, lazy: bool = False) -> tuple[KVChunk, bool]:
        """The cache of a chunk's exact tokens: (chunk, hit). A miss computes and stores it.

        lazy (query time, layer-wise store): a hit returns a `ChunkView` carrying only the
        probe sidecar; its layers stream in through the prefetcher during fused prefill.
        """
        if ids.numel() == 0:
            raise ValueError("cannot cache an empty chunk")
        key = ChunkKey.for_tokens(self.fingerprint, ids)
        if node_id is not None:
            self.store.link(NodeId(node_id), key)
        if lazy and self.prefetcher is not None and self.store.contains(key):
            return self._view(key, ids), True
        chunk = self.store.get(key)
        hit = chunk is not None
        if chunk is None:
            k, v = self.prefill_alone(ids)
            chunk = KVChunk(key, ids.clone(), k, v)
            self._add_anchors(chunk)
            self.store.put(chunk)
            if self.prefetcher is not None:
                self._put_probe_sidecar(chunk)
        return chunk, hit

    # -- layer-wise loading (stores with sidecars)
    @property
    def critical_layers(self) -> list[int]:
        """The critical layers the probe reads: selection options, else the model's profile."""
        from qcfuse_core import critical_layers

        opts = self._qcfuse_options()
        if opts.critical_layers:
            return list(opts.critical_layers)
        if self._critical is None:
            self._critical = critical_layers.lookup(self.adapter)[0]  # once per engine
        return self._critical

    def _put_probe_sidecar(self, chunk: KVChunk) -> None:
        """Store what the probe needs of a chunk (anchors + their K/V, critical-layer K) beside it."""
        from qcfuse_core.prefetch import probe_sidecar

        crit = self.critical_layers
        anchors, layer_keys = probe_sidecar(self.adapter, chunk, max(crit) + 1, crit, self._qcfuse_options().anchors)
        self.store.put_sidecar(chunk.key, anchors=anchors, layer_keys=layer_keys)

    def _view(self, key: ChunkKey, ids: torch.Tensor):
        from qcfuse_core.prefetch import ensure_sidecar

        crit, anchors = self.critical_layers, self._qcfuse_options().anchors
        depth = max(crit) + 1
        try:
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)
        except KeyError:  # stored before sidecars existed (or the sidecar was damaged): make it once
            ensure_sidecar(self.store, self.adapter, key, depth, crit, anchors)
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)

    def _add_anchors(self, chunk: KVChunk) -> None:
        """Ingestion-time anchors for qcfuse (chunk.anchors[method], layers 0..max critical)."""
        from qcfuse_core.anchors import ensure_anchors

        opts = self._qcfuse_options()
        if opts.anchor_method == "repeat" and self.adapter.tokenizer is None:
            return  # repeat anchors need a tokenizer; the selector reports it if asked for
        ensure_anchors(self.adapter, chunk, max(self.critical_layers) + 1, opts.anchors)

    def _qcfuse_options(self):
        from qcfuse_core.selectors import QCFuseOptions

        return QCFuseOptions.from_options(self.config.selection_options)

    def build_chunk(self, text: str, node_id: str | None = None) -> ChunkKey:
        """Ingestion: compute (if new) and store the cache of `text` as it appears in prompts,
        and register the text so `complete` finds it inside framework prompts."""
        chunk, _ = self.chunk_cache(self.tokenize(text), node_id)
        self.texts.add(text, node_id)
        return chunk.key

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

    def fuse_pieces(self, pieces: Sequence[Piece], *, caches: bool = True, lazy: bool = False) -> tuple[FusedPrompt, int, int]:
        """Tokenize piece by piece and attach caches -> (prompt, chunk hits, chunk misses).

        caches=False only tokenizes (full prefill needs no chunk cache); lazy: see chunk_cache.
        """
        segments, hits, misses = [], 0, 0
        for p in pieces:
            ids = self.tokenize(p.text)
            if ids.numel() == 0:
                continue
            if p.kind in ("prefix", "chunk") and caches:
                chunk, hit = self.chunk_cache(ids, p.node_id, lazy=lazy and p.kind == "chunk")
                if p.kind == "chunk":
                    hits, misses = hits + hit, misses + (not hit)
                segments.append(Segment(p.kind, ids, chunk, p.node_id, hit))
            else:
                segments.append(Segment(p.kind, ids))
        return FusedPrompt(segments), hits, misses

    # ------------------------------------------------------------------ answering
    def answer(self, question: str, documents: Sequence[str], **kw) -> FusionResult:
        stream = self.stream(question, documents, **kw)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self, question: str, documents: Sequence[str], *, node_ids=None, method: str | None = None,
        ratio: float | None = None, generation: GenerationConfig | None = None, **gen_kw,
    ) -> TokenStream:
        return self.stream_pieces(lambda: self.rag_pieces(question, documents, node_ids), method=method,
                                  ratio=ratio, generation=generation, **gen_kw)

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
                      generation: GenerationConfig | None = None, **gen_kw) -> TokenStream:
        method = method or self.config.method
        if method not in SELECTORS:
            raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(SELECTORS))}")
        ratio = self.config.ratio if ratio is None else ratio
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        gen = generation or GenerationConfig()
        if gen_kw:
            gen = replace(gen, **gen_kw)
        return TokenStream(self._run(make_pieces, method, ratio, gen))

    def _run(self, make_pieces, method: str, ratio: float, gen: GenerationConfig) -> Iterator[str]:
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        # 1. lookup; 2. start streaming the chunks' layers (layer-wise stores)
        pieces = make_pieces()
        streaming = self.prefetcher is not None and method != "full"
        prompt, hits, misses = self.fuse_pieces(pieces, caches=method != "full", lazy=streaming)
        T = prompt.num_tokens
        plan = self._plan(prompt, method, ratio) if streaming else None
        if plan is not None and plan.all_recompute:  # loading cannot beat recomputing: full prefill
            method, streaming = "full", False
        if streaming:
            self.prefetcher.start(prompt)
        timings["lookup_ms"] = _ms(t0)
        # 2. select
        t1 = time.perf_counter()
        selector = get_selector(method)
        sel = selector.select(SelectionContext(self.adapter, prompt, ratio, seed=self.config.seed,
                                               options=dict(self.config.selection_options)))
        timings["select_ms"] = _ms(t1)
        # 3. fuse (or full prefill)
        t2 = time.perf_counter()
        cache = KVCache(self.adapter, T + gen.max_new_tokens)
        if method == "full":
            logits, kv = self.adapter.hf_forward(prompt.token_ids)
            fill_from_hf(cache, kv)
            recomputed = prompt.context_tokens
        else:
            out = fused_prefill(self.adapter, prompt, sel.rows, full_layers=sel.full_layers,
                                on_layer_end=sel.on_layer_end, kv_out=cache,
                                source=self.prefetcher if streaming else None)
            if streaming:
                report = self.prefetcher.finish()
                timings["load_wait_ms"] = report.total_wait_ms
                if report.failed:  # a layer could not be read: never answer from a hole
                    log.warning("%d chunk cache(s) unreadable mid-request; recomputing them", len(report.failed))
                    for i in report.failed:  # segment indices
                        self.store.delete(prompt.segments[i].chunk.key)
                    prompt, hits, misses = self.fuse_pieces(pieces)  # the deleted ones count as misses
                    sel = selector.select(SelectionContext(self.adapter, prompt, ratio, seed=self.config.seed,
                                                           options=dict(self.config.selection_options)))
                    out = fused_prefill(self.adapter, prompt, sel.rows, full_layers=sel.full_layers,
                                        on_layer_end=sel.on_layer_end, kv_out=cache)
            logits = out.logits
            recomputed = _context_rows(prompt, out.rows)
            sel.details.setdefault("layer_ms", out.layer_ms)
        timings["prefill_ms"] = _ms(t2)
        # 4. decode
        sampler = Sampler(gen)
        assembler = TextAssembler(self.tokenizer, gen.stop)
        eos = self._eos_ids()
        token = sampler(logits[-1])
        ttft = _ms(t0)
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
            token = sampler(decode_step(self.adapter, cache, token))
        tail = assembler.finish()
        if tail:
            yield tail
        return FusionResult(
            text=assembler.text, token_ids=ids, method=method,
            ratio=ratio if selector.uses_ratio else None, ttft_ms=ttft, total_ms=_ms(t0),
            context_tokens=prompt.context_tokens, prompt_tokens=T, recomputed_tokens=recomputed,
            cache_hits=hits, cache_misses=misses, chunks=len(prompt.chunk_spans()), finish_reason=finish,
            timings_ms=timings, selection=sel, store_stats=self.store.stats(),
            plan=plan.to_dict() if plan is not None else {},
        )

    def _plan(self, prompt: FusedPrompt, method: str, ratio: float):
        """Load-or-recompute per chunk from measured rates (None without rates). Chunks the
        plan recomputes lose their cache in `prompt` (so they are recomputed whole)."""
        if self.rates is None:
            return None
        segs = [s for s in prompt.segments if s.kind == "chunk" and s.chunk is not None]
        tiers = [self.prefetcher.tier_of(s.chunk.key) or "host" for s in segs]  # just built: in memory
        p = plan_chunks(self.rates, [(len(s), t) for s, t in zip(segs, tiers)],
                        ratio=ratio if get_selector(method).uses_ratio else 0.0,
                        total_tokens=prompt.num_tokens, fresh_rows=int(prompt.uncached_mask().sum()),
                        full_layers=2 if method == "cacheblend" else 0, num_layers=self.adapter.num_layers)
        for i in p.recomputed:
            segs[i].chunk = None
        return p

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.adapter.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(i) for i in src)
        return ids


def _context_rows(prompt: FusedPrompt, rows: torch.Tensor) -> int:
    return int(prompt.mask("chunk", "text")[rows].sum())


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _chat_frame(tokenizer, system: str) -> tuple[str, str]:
    """(head, tail) of the model's chat template around one user message; plain text without one."""
    if tokenizer is None:
        return "", ""
    if not getattr(tokenizer, "chat_template", None):
        return (system + "\n\n" if system else ""), "\n"
    sentinel = "\x00QCFUSE-USER\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": sentinel}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, _, tail = rendered.partition(sentinel)
    return head, tail


__all__ = ["EngineConfig", "Piece", "QCFuseEngine", "SelectionResult", "TokenStream"]


def open_engine(
    store_dir: str | Path | None = None, *, model: str | None = None, dtype=None, device: str = "cpu",
    config: EngineConfig | None = None, memory_bytes: int | None = None,
) -> QCFuseEngine:
    """An engine over a persistent store folder (default: <cache dir>/store).

    Layout of `store_dir`: kv/ (chunk caches), chunk_texts.sqlite (content index), chroma/
    (the vector store, used by the CLI and integrations), rates-*.json (measured by `qcfuse
    bench ttft --store DIR`; with them the planner decides load vs recompute per chunk).
    Models are loaded once per process.
    """
    from qcfuse_core.model import cache_dir
    from qcfuse_core.store import kv_dir, open_store

    root = Path(store_dir) if store_dir is not None else cache_dir() / "store"
    root.mkdir(parents=True, exist_ok=True)
    key = (str(model), str(dtype), device)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = load_model(model, dtype=dtype, device=device)
    store_kw = {} if memory_bytes is None else {"memory_bytes": memory_bytes}
    store = open_store(kv_dir(root), **store_kw)
    adapter = _ADAPTERS[key]
    rates = load_rates(rates_path(root, adapter.fingerprint(), device_name(adapter.device)))
    return QCFuseEngine(adapter, store=store, config=config,
                        text_index=ChunkTextIndex(root / "chunk_texts.sqlite"), rates=rates)


_ADAPTERS: dict[tuple[str, str, str], ModelAdapter] = {}
