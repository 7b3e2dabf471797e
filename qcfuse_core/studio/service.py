"""StudioService: what the page asks for, over one engine and one Chroma collection.

Nothing here re-implements a request: a run calls `engine.stream` once per mode (the
engine's six steps, `sync_stages=True` so each stage shows its own device time) and reads
everything it shows from the `FusionResult`. Model work (runs, ingestion, model switches)
runs on the app's single worker thread, one at a time, so the TTFTs shown side by side were
not measured while another run shared the cores.

    search(question, top_k)        top-k chunks from Chroma with scores, tokens, anchors
    run(RunSpec, emit, cancel)     the chunk caches built first (a timed build step), then
                                   each mode N times through `engine.stream` -> summaries with
                                   the median TTFT, decode rate, end-to-end time, memory and
                                   quality against full prefill (quality.py); a full-prefill
                                   reference runs when full is not a mode; every mode becomes
                                   a row of the run history (history())
    details(run_id, index)         the per-token view of one mode (details.py)
    ingest_files(files, progress)  chunk, embed into Chroma, build the chunk caches
    models() / select_model(id)    installed models; switching loads one (a packaged model
                                   not converted yet is converted first, once, into the cache
                                   dir; start_model_job runs it in the background with stages)
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qcfuse_core.ingest.corpus import (
    DEMO_QUESTIONS,  # the sample corpus's questions
    TEXT_SUFFIXES,
    Chunk,
    chunks_from_file,
    iter_text_files,
    sample_corpus_dir,
    split_text,
)
from qcfuse_core.store.tier_report import tier_table
from qcfuse_core.studio.details import mode_details, token_pieces, waterfall
from qcfuse_core.studio.models import ModelEntry, conversion_state, initial_model, installed_models
from qcfuse_core.studio.quality import drop_logits, quality, speed
from qcfuse_core.studio.quality import representative as _representative
from qcfuse_core.types import FusionResult, chunk_id

log = logging.getLogger(__name__)

PAGE_METHODS = ("qcfuse", "full", "cacheblend", "epic", "naive", "adaptive")  # the page's mode chips (adaptive:
# only for a model with an adaptive-budget calibration)
Emit = Callable[[str, dict], None]
Progress = Callable[[str, int, int], None]  # (stage, done, total)


# ---------------------------------------------------------------------------- errors


class StudioError(ValueError):
    """A bad request, with the HTTP status the app answers it with."""

    status = 422
    kind = "invalid_request"


class NotFound(StudioError):
    status = 404
    kind = "not_found"


class TooLarge(StudioError):
    status = 413
    kind = "too_large"


class Unsupported(StudioError):
    status = 415
    kind = "unsupported_media_type"


class RunCancelled(Exception):
    """The run's client went away (its stream was closed): the run stopped at the next token."""


# ---------------------------------------------------------------------------- config and specs


@dataclass(frozen=True)
class StudioConfig:
    store: Path
    models: tuple[str, ...] = ()  # packaged names or model folders to offer; the first is loaded
    dtype: str = "bf16"
    device: str = "cpu"
    chunk_chars: int = 1200  # as `qcfuse ingest`
    max_upload_bytes: int = 1 << 20  # per file
    max_files: int = 16
    max_chunks: int = 8  # chunks per run
    max_modes: int = 6
    max_new_tokens: int = 48
    max_repeats: int = 10  # timed repeats per mode (the page's N)
    max_json_bytes: int = 64 * 1024  # a JSON request body larger than this gets a 413
    runs_kept: int = 16  # runs whose details stay available
    history_kept: int = 500  # rows of the run history
    warmup: bool = True  # warm-up answers after a model switch (the CLI also warms up at start)

    def __post_init__(self) -> None:
        for name in (
            "chunk_chars",
            "max_upload_bytes",
            "max_files",
            "max_chunks",
            "max_modes",
            "max_new_tokens",
            "max_repeats",
            "max_json_bytes",
            "runs_kept",
            "history_kept",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Mode:
    method: str
    ratio: float = 0.15

    def __post_init__(self) -> None:
        from qcfuse_core.selection.base import SELECTORS

        if self.method not in SELECTORS:
            raise StudioError(f"unknown method {self.method!r}; valid: {', '.join(sorted(SELECTORS))}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 <= self.ratio <= 1.0:
            raise StudioError(f"ratio must be a number in [0, 1], got {self.ratio!r}")

    @property
    def label(self) -> str:
        from qcfuse_core.selection.base import get_selector

        return f"{self.method} @ {self.ratio:.2f}" if get_selector(self.method).uses_ratio else self.method


@dataclass(frozen=True)
class RunSpec:
    question: str
    chunk_ids: tuple[str, ...]
    modes: tuple[Mode, ...]
    max_new_tokens: int = 48
    reference: bool = True  # run full prefill too when it is not a mode (agreement, speedup, quality)
    repeats: int = 1  # timed answers per mode: the TTFT shown is their median


@dataclass
class Job:
    """An ingestion in the background; `version` grows with every change (SSE polls it)."""

    id: str
    kind: str
    state: str = "queued"  # queued | running | done | failed
    stage: str = ""
    done: int = 0
    total: int = 0
    result: dict | None = None
    error: str | None = None
    version: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def update(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, v)
            self.version += 1

    def to_dict(self) -> dict:
        with self._lock:
            return {
                "id": self.id,
                "kind": self.kind,
                "state": self.state,
                "stage": self.stage,
                "done": self.done,
                "total": self.total,
                "result": self.result,
                "error": self.error,
                "version": self.version,
            }


@dataclass
class _Run:
    id: str
    spec: RunSpec
    results: list[FusionResult]
    summaries: list[dict]
    pieces: list[str]
    num_layers: int
    details: dict[int, dict] = field(default_factory=dict)


# ---------------------------------------------------------------------------- service


class StudioService:
    def __init__(self, config: StudioConfig, *, engine=None, collection=None) -> None:
        self.config = config
        self._models = installed_models(config.models)
        if not self._models:
            raise ImportError("no model to load: install the embedded one (make setup) or pass --model DIR")
        self.model: ModelEntry = initial_model(self._models, config.models)
        self._model_job: Job | None = None  # the model switch in progress (status shows it)
        self.engine = engine if engine is not None else self._open_engine(self.model)
        if collection is None:  # its writes hold the store's index lock: readers never see them half-done
            from qcfuse_core.retrieval.chroma import open_collection
            from qcfuse_core.retrieval.reader import LockedCollection, index_lock

            with index_lock(Path(config.store), exclusive=True):  # Chroma writes when it opens the index
                collection = LockedCollection(open_collection(Path(config.store) / "chroma"), Path(config.store))
        self.collection = collection
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._history: list[dict] = []  # the run history's rows, oldest first
        self._lock = threading.Lock()  # the registries above

    def _open_engine(self, entry: ModelEntry):
        from qcfuse_core.engine.api import open_engine

        return open_engine(self.config.store, model=entry.load_arg, dtype=self.config.dtype, device=self.config.device)

    # -- status ---------------------------------------------------------------------------
    def status(self) -> dict:
        from qcfuse_core.selection.base import SELECTORS

        a = self.engine.adapter
        job = self._model_job
        return {
            "model": {
                **self.model.to_dict(),
                "layers": a.num_layers,
                "device": str(a.device),
                "dtype": str(a.dtype).replace("torch.", ""),
                "fingerprint": a.fingerprint(),
                "prompt_frame": prompt_frame(self.engine),
            },
            "loading": job.to_dict() if job is not None and job.state in ("queued", "running") else None,
            "store": str(self.config.store),
            "chunks": self.collection.count(),
            "methods": self._page_methods(),
            "all_methods": sorted(SELECTORS),
            "adaptive_shares": self._adaptive_shares(),
            "memory_kind": RunMemory.kind(a.device),
            "default_ratio": self.engine.config.ratio,
            "examples": list(DEMO_QUESTIONS) if self._has_sample() else [],
            "limits": {
                "max_upload_bytes": self.config.max_upload_bytes,
                "max_files": self.config.max_files,
                "max_chunks": self.config.max_chunks,
                "max_modes": self.config.max_modes,
                "max_repeats": self.config.max_repeats,
                "max_new_tokens": self.config.max_new_tokens,
                "suffixes": list(TEXT_SUFFIXES),
            },
        }

    def fidelity(self) -> dict:
        """The engine's audit of its answers (engine/audit.py; `engine.stats().fidelity`): the
        answer-token agreement with full prefill per configuration and chunk-length band."""
        engine = self.engine
        return engine.audit.stats(engine.config.method)

    def store_tiers(self) -> dict:
        """The store's tiers now: entries, bytes used / capacity, hits, misses, hit rate and
        evictions per tier, counted since the studio started (store/tier_report.py)."""
        stats = self.engine.caches.store.stats()
        return {"backend": stats.get("backend"), "tiers": tier_table(stats)}

    def _has_sample(self) -> bool:
        got = self.collection.get(where={"source": SAMPLE_MARKER}, limit=1, include=[])
        return bool(got["ids"])

    # -- search ---------------------------------------------------------------------------
    def search(self, question: str, top_k: int = 4) -> list[dict]:
        """Top-k chunks for `question` (cosine similarity), each with its token pieces and its
        layer-0 anchors when this model's cache of it exists."""
        from qcfuse_core.retrieval.embedder import get_embedder

        question = _question(question)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 50:
            raise StudioError(f"top_k must be an integer in [1, 50], got {top_k!r}")
        n = self.collection.count()
        if n == 0:
            return []
        res = self.collection.query(
            query_embeddings=[get_embedder().embed_one(question)],
            n_results=min(top_k, n),
            include=["documents", "metadatas", "distances"],
        )
        out = []
        for cid, text, meta, dist in zip(res["ids"][0], res["documents"][0], res["metadatas"][0], res["distances"][0]):
            out.append(
                {
                    "id": cid,
                    "source": (meta or {}).get("source", ""),
                    "score": round(1.0 - float(dist), 4),
                    "text": text,
                    **self._chunk_view(text),
                }
            )
        return out

    def _chunk_view(self, text: str) -> dict:
        ids, key = self.engine.caches.chunk_tokens(text)
        anchors: list[int] = []
        store = self.engine.caches.store
        cached = store.contains(key)
        if cached and hasattr(store, "get_sidecar"):
            side = store.get_sidecar(key)
            method = self.engine.config.selection.anchor_method
            a = side.anchors.get(method) if side is not None else None
            if a is not None and a.dim() == 2 and a.shape[0]:
                anchors = [int(i) for i in a[0].tolist()]
        return {"tokens": token_pieces(self.engine.tokenizer, ids.tolist()), "anchors": anchors, "cached": cached}

    def chunks(self, chunk_ids: Sequence[str]) -> list[dict]:
        """The chunk cards of `chunk_ids` as they are now (cached or not for the loaded model,
        its anchors): the page refreshes its cards with it after a run built their caches."""
        texts = self.chunk_texts(chunk_ids)
        got = self.collection.get(ids=list(chunk_ids), include=["metadatas"])
        meta = dict(zip(got["ids"], got["metadatas"]))
        return [
            {"id": cid, "source": (meta.get(cid) or {}).get("source", ""), "text": text, **self._chunk_view(text)}
            for cid, text in zip(chunk_ids, texts)
        ]

    def chunk_texts(self, chunk_ids: Sequence[str]) -> list[str]:
        """Texts of the chunks, in the order given; NotFound names the unknown ids."""
        if not chunk_ids:
            raise StudioError("chunk_ids is empty: pick at least one chunk")
        if len(chunk_ids) > self.config.max_chunks:
            raise StudioError(f"at most {self.config.max_chunks} chunks per run, got {len(chunk_ids)}")
        if len(set(chunk_ids)) != len(chunk_ids):
            raise StudioError("chunk_ids has duplicates")
        got = self.collection.get(ids=list(chunk_ids), include=["documents"])
        found = dict(zip(got["ids"], got["documents"]))
        unknown = [c for c in chunk_ids if c not in found]
        if unknown:
            raise NotFound(f"unknown chunk id(s): {', '.join(map(repr, unknown))}")
        return [found[c] for c in chunk_ids]

    # -- runs -----------------------------------------------------------------------------
    def check_run(self, spec: RunSpec) -> list[str]:
        """Validate a run before it is queued -> the chunk texts."""
        _question(spec.question)
        if not spec.modes:
            raise StudioError("modes is empty: pick at least one mode")
        if len(spec.modes) > self.config.max_modes:
            raise StudioError(f"at most {self.config.max_modes} modes per run, got {len(spec.modes)}")
        if not 1 <= spec.max_new_tokens <= 256:
            raise StudioError(f"max_new_tokens must be in [1, 256], got {spec.max_new_tokens}")
        if (
            isinstance(spec.repeats, bool)
            or not isinstance(spec.repeats, int)
            or not 1 <= spec.repeats <= self.config.max_repeats
        ):
            raise StudioError(f"repeats must be an integer in [1, {self.config.max_repeats}], got {spec.repeats!r}")
        for m in spec.modes:
            if m.method == "adaptive":
                shares = self._adaptive_shares()
                if not shares:
                    raise StudioError(
                        f"adaptive needs a calibration of {self.model.name}; none is shipped or "
                        "calibrated (qcfuse calibrate-budget); valid methods here: "
                        f"{', '.join(self._page_methods())}"
                    )
                if not shares[0] - 1e-9 <= m.ratio <= shares[-1] + 1e-9:
                    raise StudioError(
                        f"adaptive's ratio must be within its calibrated mean shares "
                        f"[{shares[0]:g}, {shares[-1]:g}] for {self.model.name}, got {m.ratio:g}"
                    )
        return self.chunk_texts(spec.chunk_ids)

    def _adaptive_shares(self) -> list[float]:
        """The mean recompute shares this model's adaptive budget is calibrated at ([] : none)."""
        from qcfuse_core.selection.adaptive import lookup_calibration

        cal, _ = lookup_calibration(self.engine.adapter)
        return sorted(float(x) for x in (cal or {}).get("targets", {}))

    def _page_methods(self) -> list[str]:
        """The page's mode chips: adaptive only where the model has a calibration."""
        return [m for m in PAGE_METHODS if m != "adaptive" or self._adaptive_shares()]

    def run(self, spec: RunSpec, emit: Emit | None = None, cancel: threading.Event | None = None) -> dict:
        """The run, in numbered steps (events to `emit` as they happen):

            1. build   every chunk's cache for this model, timed, before any mode is timed:
                       build {state, ms, built, cached}
            2. full    the reference (when full is not a mode), `repeats` times:
                       reference {state, ...}
            3. modes   each mode `repeats` times; the first repeat streams its text:
                       mode {index, label}, delta {index, text}, repeat {index, k, ttft_ms},
                       result {index, ...summary}
            4. compare every mode against full prefill (quality.py) -> summaries, history rows

        `cancel` set (the client went away) stops the run at the next token: RunCancelled."""
        emit = emit or (lambda event, data: None)
        cancel = cancel or threading.Event()
        docs = self.check_run(spec)
        engine = self.engine
        model = self.model
        _check_cancel(cancel)
        # 1. build
        emit("build", {"state": "running", "chunks": len(docs)})
        build = self._build(engine, spec, docs)
        emit("build", {"state": "done", **build})
        # 2. the reference
        full_i = next((i for i, m in enumerate(spec.modes) if m.method == "full"), None)
        full_reps, full_mem = None, None
        if full_i is None and spec.reference:
            emit("reference", {"state": "running"})
            full_reps, full_mem = self._repeats(engine, spec, docs, Mode("full"), lambda d: None, cancel)
        # 3. the modes
        reps: list[list[FusionResult]] = []
        mems: list[dict] = []
        for i, mode in enumerate(spec.modes):
            emit(
                "mode",
                {"index": i, "method": mode.method, "ratio": mode.ratio, "label": mode.label, "repeats": spec.repeats},
            )
            got, mem = self._repeats(
                engine,
                spec,
                docs,
                mode,
                lambda d, i=i: emit("delta", {"index": i, "text": d}),
                cancel,
                lambda k, r, i=i: emit("repeat", {"index": i, "k": k, "ttft_ms": round(r.ttft_ms, 3)}),
            )
            reps.append(got)
            mems.append(mem)
            emit("result", {"index": i, **_summary(_representative(got), mode, mem, got)})
        # 4. compare
        if full_i is not None:
            full_reps, full_mem = reps[full_i], mems[full_i]
        full = _representative(full_reps) if full_reps is not None else None
        full_speed = speed(full_reps) if full_reps is not None else None
        reference = None
        if full_i is None and full is not None:
            assert full_speed is not None  # both come from full_reps
            reference = {
                "answer": full.text,
                "ttft_ms": full_speed.ttft_ms,
                "total_ms": full_speed.total_ms,
                "decode_tok_s": full_speed.decode_tok_s,
                "repeats": full_speed.repeats,
                "memory": full_mem,
                "new_tokens": len(full.token_ids),
            }
            emit("reference", {"state": "done", **reference})
        summaries = []
        for i, (got, mode, mem) in enumerate(zip(reps, spec.modes, mems)):
            r = _representative(got)
            s = {"index": i, **_summary(r, mode, mem, got)}
            if full is not None:
                assert full_speed is not None  # both come from full_reps
                s["speedup_vs_full"] = round(full_speed.ttft_ms / s["ttft_ms"], 3) if s["ttft_ms"] > 0 else None
                s["agreement"] = agreement(r, full)
                s["quality"] = quality([r, *(x for x in got if x is not r)], full).to_dict()
            summaries.append(s)
        results = [drop_logits(_representative(got)) for got in reps]
        prompt_ids = results[0].prompt_ids
        assert prompt_ids is not None  # the engine's results carry their prompt's tokens
        pieces = token_pieces(engine.tokenizer, prompt_ids.tolist())
        run = _Run(uuid.uuid4().hex[:12], spec, results, summaries, pieces, engine.adapter.num_layers)
        rows = [_history_row(run.id, model, spec, s) for s in summaries]
        if full_i is None and full is not None:
            assert full_speed is not None and full_reps is not None  # full comes from full_reps
            rows.append(
                _history_row(
                    run.id,
                    model,
                    spec,
                    {
                        "index": None,
                        "method": "full",
                        "ratio": None,
                        "label": "full (reference)",
                        "ran_as": "full",
                        "answer": full.text,
                        "ttft_ms": full_speed.ttft_ms,
                        "total_ms": full_speed.total_ms,
                        "decode_tok_s": full_speed.decode_tok_s,
                        "repeats": full_speed.repeats,
                        "recompute_share": 1.0,
                        "memory": full_mem,
                        "quality": quality([full, *(x for x in full_reps if x is not full)], full).to_dict(),
                        "speedup_vs_full": 1.0,
                    },
                )
            )
        with self._lock:
            self._runs[run.id] = run
            while len(self._runs) > self.config.runs_kept:
                self._runs.popitem(last=False)
            self._history.extend(rows)
            del self._history[: max(0, len(self._history) - self.config.history_kept)]
        return {
            "run_id": run.id,
            "question": spec.question,
            "chunk_ids": list(spec.chunk_ids),
            "model": model.id,
            "model_name": model.name,
            "repeats": spec.repeats,
            "build": build,
            "results": summaries,
            "reference": reference,
            "history": rows,
        }

    def history(self) -> dict:
        """Every run's rows, oldest first (model x mode x ratio, one row per mode of a run)."""
        with self._lock:
            return {"rows": list(self._history), "kept": self.config.history_kept}

    def clear_history(self) -> dict:
        with self._lock:
            self._history.clear()
        return self.history()

    def _build(self, engine, spec: RunSpec, docs: list[str]) -> dict:
        """Step 1: the caches of the run's chunks that this model lacks, built now (timed), so
        that no mode pays for building them."""
        keys = [engine.caches.chunk_tokens(d)[1] for d in docs]
        missing = [i for i, k in enumerate(keys) if k is not None and not engine.caches.store.contains(k)]
        t0 = time.perf_counter()
        if missing:
            engine.build_chunks([docs[i] for i in missing], [spec.chunk_ids[i] for i in missing])
        ms = (time.perf_counter() - t0) * 1000.0
        return {"ms": round(ms, 3), "built": len(missing), "cached": len(docs) - len(missing)}

    def _repeats(
        self, engine, spec: RunSpec, docs: list[str], mode: Mode, on_delta, cancel: threading.Event, on_repeat=None
    ) -> tuple[list[FusionResult], dict]:
        """`spec.repeats` answers of one mode (the first streams its text) -> (results, memory:
        the largest of the repeats' own measures)."""
        out, mems = [], []
        for k in range(spec.repeats):
            r, mem = self._answer(engine, spec, docs, mode, on_delta if k == 0 else (lambda d: None), cancel)
            out.append(r)
            mems.append(mem)
            if on_repeat is not None:
                on_repeat(k, r)
        return out, max(mems, key=lambda m: m["peak_bytes"] if m["peak_bytes"] is not None else -1)

    def _answer(
        self, engine, spec: RunSpec, docs: list[str], mode: Mode, on_delta, cancel: threading.Event | None = None
    ) -> tuple[FusionResult, dict]:
        _check_cancel(cancel)
        meter = RunMemory(engine.adapter.device)
        stream = engine.stream(
            spec.question,
            docs,
            node_ids=list(spec.chunk_ids),
            method=mode.method,
            ratio=mode.ratio,
            sync_stages=True,
            max_new_tokens=spec.max_new_tokens,
            stop=tuple(prompt_frame(engine)["stop"]),
        )
        for delta in stream:
            if cancel is not None and cancel.is_set():
                stream.close()  # the request ends here: its state is released
                raise RunCancelled("the run was cancelled")
            on_delta(delta)
        return stream.result, meter.stop()

    def details(self, run_id: str, index: int) -> dict:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            raise NotFound(f"unknown run {run_id!r} (runs kept: the last {self.config.runs_kept})")
        if not 0 <= index < len(run.results):
            raise NotFound(f"run {run_id} has modes 0..{len(run.results) - 1}, not {index}")
        got = run.details.get(index)
        if got is None:
            r = run.results[index]
            assert r.prompt_ids is not None and run.results[0].prompt_ids is not None  # the engine sets them
            pieces = (
                run.pieces
                if torch.equal(r.prompt_ids, run.results[0].prompt_ids)
                else token_pieces(self.engine.tokenizer, r.prompt_ids.tolist())
            )
            got = {"run_id": run_id, **run.summaries[index], **mode_details(r, pieces, run.num_layers)}
            run.details[index] = got
        return got

    # -- ingestion ------------------------------------------------------------------------
    def ensure_corpus(self, progress: Progress | None = None) -> dict | None:
        """An empty store gets the sample corpus; a store with chunks is left as it is."""
        if self.collection.count() > 0:
            return None
        chunks = [
            c for f in iter_text_files([sample_corpus_dir()]) for c in chunks_from_file(f, self.config.chunk_chars)
        ]
        return self.ingest_chunks(chunks, progress)

    def prepare_files(self, files: Sequence[tuple[str, bytes]]) -> list[tuple[str, str]]:
        """Check uploads -> (name, text): a text/markdown suffix, the size limit, UTF-8, not empty."""
        if not files:
            raise StudioError("no files uploaded")
        if len(files) > self.config.max_files:
            raise TooLarge(f"at most {self.config.max_files} files per upload, got {len(files)}")
        out = []
        for name, data in files:
            name = Path(name or "").name
            if not name:
                raise StudioError("an uploaded file has no name")
            if Path(name).suffix.lower() not in TEXT_SUFFIXES:
                raise Unsupported(f"{name}: only text and markdown files ({', '.join(TEXT_SUFFIXES)}) can be ingested")
            if len(data) > self.config.max_upload_bytes:
                raise TooLarge(
                    f"{name} is {len(data):,} bytes; the limit is {self.config.max_upload_bytes:,} bytes per file"
                )
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise StudioError(f"{name} is not UTF-8 text (bad byte at offset {e.start})") from None
            if not text.strip():
                raise StudioError(f"{name} is empty")
            out.append((name, text))
        return out

    def ingest_files(self, files: Sequence[tuple[str, str]], progress: Progress | None = None) -> dict:
        """Chunks as `qcfuse ingest` makes them (same ids for the same file name and text)."""
        chunks = [
            Chunk(chunk_id(name, t), t, name) for name, text in files for t in split_text(text, self.config.chunk_chars)
        ]
        return self.ingest_chunks(chunks, progress)

    def ingest_chunks(self, chunks: list[Chunk], progress: Progress | None = None) -> dict:
        """Embed the new chunks into Chroma, then build every chunk's cache (idempotent)."""
        from qcfuse_core.retrieval.embedder import get_embedder

        progress = progress or (lambda stage, done, total: None)
        chunks = list({c.id: c for c in chunks}.values())  # a repeated paragraph or file: once
        existing = set(self.collection.get(ids=[c.id for c in chunks], include=[])["ids"]) if chunks else set()
        new = [c for c in chunks if c.id not in existing]
        embedder = get_embedder()
        progress("embedding", 0, len(new))
        for i in range(0, len(new), EMBED_BATCH):
            batch = new[i : i + EMBED_BATCH]
            self.collection.add(
                ids=[c.id for c in batch],
                documents=[c.text for c in batch],
                embeddings=embedder.embed([c.text for c in batch]),
                metadatas=[{"source": c.source} for c in batch],
            )
            progress("embedding", i + len(batch), len(new))
        progress("caches", 0, len(chunks))
        for i in range(0, len(chunks), CACHE_BATCH):  # a few chunks per call: progress moves
            batch = chunks[i : i + CACHE_BATCH]
            self.engine.build_chunks([c.text for c in batch], [c.id for c in batch])
            progress("caches", i + len(batch), len(chunks))
        return {
            "chunks": len(chunks),
            "new_in_chroma": len(new),
            "chunk_ids": [c.id for c in chunks],
            "sources": sorted({c.source for c in chunks}),
        }

    def new_job(self, kind: str) -> Job:
        job = Job(uuid.uuid4().hex[:12], kind)
        with self._lock:
            self._jobs[job.id] = job
            while len(self._jobs) > JOBS_KEPT:
                self._jobs.popitem(last=False)
        return job

    def job(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job

    def run_ingest_job(self, job: Job, files: list[tuple[str, str]]) -> None:
        """The job's body (on the worker): never raises, the job records the outcome."""
        job.update(state="running")
        try:
            res = self.ingest_files(files, lambda stage, done, total: job.update(stage=stage, done=done, total=total))
            job.update(state="done", result=res)
        except Exception as e:  # recorded for the page; the server keeps running
            log.exception("ingestion failed")
            job.update(state="failed", error=f"{type(e).__name__}: {e}")

    # -- models ---------------------------------------------------------------------------
    def models(self) -> dict:
        out = []
        for m in self._models:
            d = m.to_dict()
            try:
                state = conversion_state(m)
            except (ImportError, ValueError) as e:  # listed but its packages are incomplete
                d["converted"], d["problem"] = None, str(e)
            else:
                d["converted"] = None if state is None else state[1]
            out.append(d)
        return {"current": self.model.id, "models": out}

    def _entry(self, model_id: str) -> ModelEntry:
        entry = next((m for m in self._models if m.id == model_id), None)
        if entry is None:
            raise NotFound(f"unknown model {model_id!r}; installed: {', '.join(m.id for m in self._models)}")
        return entry

    def select_model(self, model_id: str, progress: Callable[[str, str], None] | None = None) -> dict:
        """Load another installed model (once per process) -> its status. A packaged model not
        converted yet is converted first (once; cached under the cache dir). `progress(stage,
        message)` hears each stage: converting, loading, warming up. Its chunk caches are
        built as the runs need them (the first run on a new model shows them as misses);
        each model's caches are its own (keys start with its fingerprint)."""
        from qcfuse_core.model.adapter import packaged_model_dir

        entry = self._entry(model_id)
        progress = progress or (lambda stage, message: None)
        if entry.id != self.model.id:
            t0 = time.perf_counter()
            state = conversion_state(entry)
            if state is not None and not state[1]:
                progress(
                    "converting",
                    f"Converting {entry.name} from its GGUF to safetensors: first time only, "
                    f"the result is kept in {state[0].parent} (minutes on a small CPU)",
                )
                assert entry.packaged is not None  # conversion_state is None for any other model
                packaged_model_dir(entry.packaged)
            progress("loading", f"Loading {entry.name} ({self.config.dtype} on {self.config.device})")
            engine, old = self._open_engine(entry), self.engine
            self.engine, self.model = engine, entry
            old.close()  # its scheduler stopped, its store and text index closed
            if self.config.warmup:
                progress("warming up", f"Warming up {entry.name}: one tiny answer per kind of prefill")
                self.warm_up()
            log.info("switched to %s in %.1f s", entry.name, time.perf_counter() - t0)
        return self.status()["model"]

    def start_model_job(self, model_id: str) -> Job:
        """A background switch (`run_model_job` on the worker); NotFound for an unknown id.
        Switching to the loaded model is a job that is done at once."""
        entry = self._entry(model_id)
        job = self.new_job("model")
        if entry.id == self.model.id and (self._model_job is None or self._model_job.state in ("done", "failed")):
            job.update(
                state="done",
                stage="loaded",
                result={"model": self.status()["model"], "message": f"{entry.name} is loaded"},
            )
            return job
        job.update(
            result={"model_id": entry.id, "name": entry.name, "message": f"Waiting to load {entry.name}"},
            stage="queued",
        )
        self._model_job = job
        return job

    def run_model_job(self, job: Job, model_id: str) -> None:
        """The job's body (on the worker): never raises; the job records the outcome."""
        job.update(state="running")

        def progress(stage: str, message: str) -> None:  # every stage is kept: a poll may miss a short one
            res = job.result or {}
            job.update(
                stage=stage,
                result={
                    **res,
                    "message": message,
                    "stages": [*res.get("stages", []), {"stage": stage, "message": message}],
                },
            )

        try:
            model = self.select_model(model_id, progress)
            job.update(
                state="done",
                stage="loaded",
                result={
                    "model": model,
                    "message": f"{model['name']} is loaded",
                    "stages": (job.result or {}).get("stages", []),
                },
            )
        except Exception as e:  # recorded for the page; the server keeps running on the old model
            log.exception("model switch failed")
            job.update(state="failed", error=f"{type(e).__name__}: {e}")

    def warm_up(self) -> None:
        """One tiny answer per kind of prefill, so the first run's TTFT is not the process's
        first-call cost (lazy initialisation, allocator growth)."""
        if self.collection.count() == 0:
            return
        docs = self.collection.get(limit=2, include=["documents"])["documents"]
        for method in ("full", "qcfuse"):
            self.engine.answer("warm-up", docs, method=method, max_new_tokens=1)


SAMPLE_MARKER = "03-zephyr-institute.md"  # a sample-corpus file: its chunks mean the examples fit
EMBED_BATCH = 32
CACHE_BATCH = 4
JOBS_KEPT = 32
QUESTION_CHARS = 2000


def _question(q: Any) -> str:
    if not isinstance(q, str) or not q.strip():
        raise StudioError("question is empty")
    if len(q) > QUESTION_CHARS:
        raise StudioError(f"question is {len(q)} characters; the limit is {QUESTION_CHARS}")
    return q.strip()


def prompt_frame(engine) -> dict:
    """The frame every prompt of this model gets, with placeholders for the question and the
    documents: the model's chat template, or (a base model: none) the engine's plain frame.
    `stop`: where the studio's answers end besides the end-of-text token (a base model has no
    end of turn: after its answer it writes the frame's next "Question:" line)."""
    pieces = engine.frame.rag_pieces("{question}", ["{document 1}", "{document 2}"])
    text = "".join(p.text for p in pieces)
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    return {
        "kind": "chat" if chat else "plain",
        "label": "the model's chat template" if chat else "plain frame (base model: no chat template)",
        "text": text,
        "stop": list(engine.frame.stops),
    }


def _summary(r: FusionResult, mode: Mode, peak: dict, repeats: Sequence[FusionResult] = ()) -> dict:
    """What the page's answer card shows, straight from the FusionResults: `r` is the
    representative repeat (the median TTFT's), `repeats` all of them (medians)."""
    load = r.load or {}
    sp = speed(repeats or [r])
    return {
        "method": mode.method,
        "ratio": mode.ratio,
        "label": mode.label,
        "ran_as": r.method,  # `full` when the planner decided fusing could not win
        "answer": r.text,
        "ttft_ms": sp.ttft_ms,
        "total_ms": sp.total_ms,
        "decode_tok_s": sp.decode_tok_s,
        "repeats": sp.repeats,
        "ttft_all_ms": list(sp.ttft_all_ms),
        "stages": waterfall(r),
        "timings_ms": {k: round(v, 3) for k, v in r.timings_ms.items()},
        "context_tokens": r.context_tokens,
        "prompt_tokens": r.prompt_tokens,
        "recomputed_tokens": r.recomputed_tokens,
        "recompute_share": round(r.recompute_share, 4),
        "cache_hits": r.cache_hits,
        "cache_misses": r.cache_misses,
        "cache_built": r.cache_built,
        "chunks": r.chunks,
        "new_tokens": len(r.token_ids),
        "finish_reason": r.finish_reason,
        "threads": r.threads,
        "guard": r.guard.to_dict() if r.guard is not None else None,  # the quality guard's signal and action
        "answered": r.what_answered(),  # what answered and what the guard did, in one line
        "memory": {
            "kv_bytes_loaded": int(load.get("bytes_loaded", 0)),
            "kv_bytes_by_tier": {k: int(v) for k, v in load.get("bytes_by_source", {}).items()},
            "load_wait_ms": round(float(load.get("total_wait_ms", 0.0)), 3),
            **peak,
        },
    }


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise RunCancelled("the run was cancelled")


def _history_row(run_id: str, model: ModelEntry, spec: RunSpec, s: dict) -> dict:
    """One row of the run history: a mode of a run, its medians and its quality (or None
    where no full prefill ran to compare with)."""
    return {
        "run_id": run_id,
        "index": s["index"],
        "model": model.id,
        "model_name": model.name,
        "question": spec.question,
        "chunks": len(spec.chunk_ids),
        "max_new_tokens": spec.max_new_tokens,
        "method": s["method"],
        "ratio": s["ratio"],
        "label": s["label"],
        "ran_as": s["ran_as"],
        "repeats": s["repeats"],
        "ttft_ms": s["ttft_ms"],
        "total_ms": s["total_ms"],
        "decode_tok_s": s["decode_tok_s"],
        "recompute_share": s["recompute_share"],
        "speedup_vs_full": s.get("speedup_vs_full"),
        "quality": s.get("quality"),
        "guard": _guard_brief(s.get("guard")),
        "memory": {"peak_bytes": s["memory"]["peak_bytes"], "peak_kind": s["memory"]["peak_kind"]},
    }


def _guard_brief(guard: dict | None) -> dict | None:
    """What the run history shows of the quality guard: its signal's value, threshold and action."""
    if guard is None:
        return None
    return {k: guard[k] for k in ("signal", "value", "threshold", "action", "code")}


class RunMemory:
    """Memory of one answer, measured around it (not the process's lifetime high-water mark):

    cuda  the device's peak allocated bytes during the answer (peak stats reset at start)
    cpu   the resident set's growth during the answer: RSS at the end - RSS at the start,
          0 when it shrank (Linux /proc/self/statm; None where that is missing)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.start = _rss_bytes()

    @staticmethod
    def kind(device: torch.device) -> str:
        return (
            "device peak during the run (allocated)"
            if device.type == "cuda"
            else "resident growth during the run (RSS end - start)"
        )

    def stop(self) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {
                "peak_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                "peak_kind": self.kind(self.device),
            }
        end = _rss_bytes()
        grew = None if end is None or self.start is None else max(0, end - self.start)
        return {"peak_bytes": grew, "peak_kind": self.kind(self.device)}


def _rss_bytes() -> int | None:
    """This process's resident set size now (Linux), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def agreement(r: FusionResult, full: FusionResult) -> dict:
    """Does this answer match full prefill's? Same text (whitespace-normalised), same first
    token, and how many leading tokens the two share."""
    a, b = r.token_ids, full.token_ids
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    same = " ".join(r.text.split()) == " ".join(full.text.split())
    return {
        "same_text": same,
        "first_token_same": bool(a and b and a[0] == b[0]),
        "common_prefix_tokens": common,
        "full_tokens": len(b),
        "share": round(common / max(len(a), len(b)), 4) if max(len(a), len(b)) else 1.0,
    }
