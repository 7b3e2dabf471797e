"""The `qcfuse` command line: ingest, ask, demo (and the store / benchmark tools).

    qcfuse ingest PATH... [--store DIR]     files/folders -> chunks -> Chroma + chunk caches
    qcfuse ask "question" [--store DIR]     retrieve top-k, fuse, answer (--json for one object)
    qcfuse demo [--store DIR]               sample corpus, three questions, full vs fused, fidelity
    qcfuse store stats|verify|gc|clear      inspect and maintain the chunk store
    qcfuse studio [--store DIR] [--port N]  the web page (qcfuse_core/studio)
    qcfuse serve [--store DIR] [--port N]   OpenAI-compatible server (qcfuse_core/serve)

Every failure a user can cause (a bad file, a read-only or damaged store, a full disk, a
prompt past the model's context) ends in a one-line `qcfuse: error: ...` naming the fix and
a non-zero exit status, or in a warning and a normal answer - never in a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from qcfuse_core.cli.flags import at_least, share
from qcfuse_core.ingest.corpus import (
    DATASET_SUFFIXES,
    DEMO_QUESTIONS,
    Chunk,
    chunks_from_file,
    demo_chunks,
    iter_text_files,
    source_name,
)
from qcfuse_core.types import chunk_id


def _default_store(name: str = "store") -> Path:
    from qcfuse_core.paths import cache_dir

    return cache_dir() / name


def warn(msg: str) -> None:
    msg = msg.encode("utf-8", "backslashreplace").decode("utf-8")  # a non-UTF-8 file name never stops a warning
    print(f"qcfuse: warning: {msg}", file=sys.stderr)


def require_utf8(text: str, what: str) -> str:
    """`text` unchanged if it is valid Unicode; ValueError naming the first bad byte when it
    holds bytes that were not UTF-8 (Python maps them to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character {bad!a}"
        raise ValueError(f"{what} is not valid UTF-8 ({byte} at position {e.start}); pass UTF-8 text") from None
    return text


def _engine(args, *, read_only: bool | None = None):
    from qcfuse_core.engine.api import open_engine
    from qcfuse_core.engine.config import EngineConfig

    cfg_kw = {}
    if getattr(args, "method", None):
        cfg_kw["method"] = args.method
    if getattr(args, "ratio", None) is not None:
        cfg_kw["ratio"] = args.ratio
    return open_engine(
        args.store,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        config=EngineConfig(**cfg_kw),
        read_only=read_only,
    )


def _tree_writable(path: Path) -> bool:
    """Every folder and file under `path` can be written (what Chroma needs to open it)."""
    if not path.exists():
        return True
    return all(os.access(p, os.W_OK) for p in [path, *path.rglob("*")])


def _reader(store: Path):
    """The store's vector index for a read (`ask`): its files read without opening Chroma,
    which writes whenever it opens an index (retrieval/reader.py); nothing in the store is
    written. A damaged index raises StoreError naming the repair."""
    from qcfuse_core.retrieval.reader import index_lock, open_reader
    from qcfuse_core.store import StoreError

    with index_lock(store, exclusive=False):  # no writer between the check and the read
        problem = _vector_index_problem(store)
        if problem:
            raise StoreError(
                f"the vector index at {store / 'chroma'} {problem}; rebuild it with "
                f"`qcfuse store verify --repair --store {store}`"
            )
        return open_reader(store)


def _collection(store: Path):
    """The store's Chroma collection, for a writer (ingest, demo): its writes hold the
    store's index lock, so readers never see a file half-written (retrieval/reader.py). A
    damaged index raises StoreError naming the repair."""
    from qcfuse_core.retrieval.chroma import open_collection
    from qcfuse_core.retrieval.reader import LockedCollection, index_lock
    from qcfuse_core.store import StoreError

    path = store / "chroma"
    problem = _vector_index_problem(store)
    if problem:
        raise StoreError(
            f"the vector index at {path} {problem}; rebuild it with `qcfuse store verify --repair --store {store}`"
        )
    chroma_errors: ModuleType | None
    try:
        import chromadb.errors as chroma_errors
    except ImportError:
        chroma_errors = None
    try:
        with index_lock(store, exclusive=True):  # Chroma writes when it opens the index
            collection = open_collection(path)
            collection.count()
        return LockedCollection(collection, store)
    except Exception as e:
        if chroma_errors is None or not isinstance(e, chroma_errors.ChromaError):
            raise
        if _disk_full(e, store):  # Chroma writes when it opens: not damage
            raise StoreError(
                f"the disk holding {store} is full and Chroma writes when it opens the vector index; "
                "free space first (`qcfuse ask` reads it without writing)"
            ) from e
        raise StoreError(
            f"the vector index at {store / 'chroma'} is unusable ({e}); rebuild it with "
            f"`qcfuse store verify --repair --store {store}`"
        ) from e


def _vector_index_problem(store: Path) -> str:
    """Why the store's vector index must not be opened in this process ('' when it may):
    missing while chunk texts are stored, damaged HNSW files (native code would crash on
    them), or a graph that lacks rows (answers would silently come from what is left)."""
    from qcfuse_core.retrieval import vector_index as vi

    path = store / "chroma"
    if (path / vi.CHROMA_DB).is_file():
        why = vi.quick_problem(path)
        return f"is unusable: {why}" if why else ""
    texts = store / "chunk_texts.sqlite"
    if not texts.is_file():
        return ""
    try:
        db = sqlite3.connect(f"{texts.resolve().as_uri()}?mode=ro", uri=True)
        try:
            n = int(db.execute("SELECT COUNT(*) FROM chunk_text").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return ""  # nothing readable to rebuild it from: a fresh index is all there can be
    return f"is missing while {n} chunk texts are stored" if n else ""


def _require_writable(store: Path) -> None:
    from qcfuse_core.store import StoreError, kv_dir, writable

    if not (
        writable(store)
        and writable(kv_dir(store))
        and _tree_writable(store / "chroma")
        and _tree_writable(store / "chunk_texts.sqlite")
    ):
        raise StoreError(
            f"the store at {store} is read-only; ingest needs a writable store "
            "(check its permissions, or pass another --store)"
        )


def kv_bytes_per_token(engine) -> int:
    """Bytes one token's cache takes on disk: L layers x (K, V) x Hkv x D x stored dtype."""
    from qcfuse_core.store.codec import stored_dtype

    storage = getattr(getattr(engine.caches.store, "config", None), "storage_dtype", "auto")
    return engine.adapter.shape.kv_bytes(1, stored_dtype(storage, engine.adapter.dtype))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# ---------------------------------------------------------------------------- ingest


EMBED_BATCH = 64
CACHE_BATCH = 8  # chunks per `build_chunks` call: batched prefill, and a progress step


KV_CONFIRM_BYTES = 1 << 30  # an ingest that would write more KV asks first (--confirm-above)
_LOW_SPACE = 1 << 20  # bytes free below which a failed write is taken for a full disk


def _disk_full(e: BaseException, where: Path | None = None) -> bool:
    """A write failed because the disk is full: by errno, by the message (SQLite and Chroma
    wrap the OS error in their own types), or - when the message says nothing - by the free
    space left on `where`'s file system."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    msg = str(e)
    if "disk is full" in msg or "No space left" in msg or "disk full" in msg or "os error 28" in msg:
        return True
    if where is not None:
        probe = Path(where)
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        try:
            return shutil.disk_usage(probe).free < _LOW_SPACE
        except OSError:
            return False
    return False


@dataclass(frozen=True)
class KVPlan:
    """What an ingest will cache: the chunks whose caches are not stored yet, their estimated
    bytes on disk (tokens x bytes per token), and those a byte cap leaves uncached."""

    todo: tuple[Chunk, ...]
    bytes_by_id: dict[str, int]
    bytes_per_token: int
    tokens: int
    total_bytes: int  # of every chunk in `todo`
    capped: frozenset[str] = frozenset()  # ids over the cap: indexed, not cached

    @property
    def cached_bytes(self) -> int:
        return sum(b for i, b in self.bytes_by_id.items() if i not in self.capped)


def plan_kv(engine, chunks: list[Chunk], max_kv_bytes: int | None = None) -> KVPlan:
    """The KV an ingest of `chunks` would write. `max_kv_bytes` (and the disk tier's
    capacity, when it has one) caps it: chunks past the cap, in order, are left uncached."""
    store = engine.caches.store
    todo = tuple(c for c in chunks if not store.contains(engine.caches.chunk_tokens(c.text)[1]))
    per = kv_bytes_per_token(engine)
    sizes = {c.id: int(engine.caches.chunk_tokens(c.text)[0].numel()) * per for c in todo}
    caps = [b for b in (max_kv_bytes, getattr(getattr(store, "disk", None), "capacity_bytes", None)) if b is not None]
    capped, used = set(), 0
    if caps:
        for c in todo:
            if used + sizes[c.id] > min(caps):
                capped.add(c.id)
            else:
                used += sizes[c.id]
    return KVPlan(todo, sizes, per, sum(sizes.values()) // per if per else 0, sum(sizes.values()), frozenset(capped))


def ingest_chunks(
    engine,
    collection,
    chunks: list[Chunk],
    progress: bool = True,
    plan: KVPlan | None = None,
    store_path: Path | None = None,
) -> dict:
    """Embed new chunks into Chroma and build their caches. Idempotent; a chunk listed twice
    is ingested once. A disk that fills while caching stops the cache writes and the result
    says how far they got; one that fills while the vector index is written raises
    StoreError (the index is then checked and rebuilt by `store verify --repair`). Chunks
    the plan caps are indexed and their texts registered, but not cached."""
    from tqdm import tqdm

    from qcfuse_core.retrieval.embedder import get_embedder
    from qcfuse_core.retrieval.vector_index import SHA_KEY, text_sha256
    from qcfuse_core.store import StoreError

    chunks = list({c.id: c for c in chunks}.values())  # one per id, first occurrence's order
    plan = plan if plan is not None else plan_kv(engine, chunks)
    embedder = get_embedder()
    indexed, new = 0, []
    try:
        existing = set(collection.get(ids=[c.id for c in chunks], include=[])["ids"]) if chunks else set()
        new = [c for c in chunks if c.id not in existing]
        with tqdm(total=len(new), desc="embedding", unit="chunk", disable=not progress or not new) as bar:
            for i in range(0, len(new), EMBED_BATCH):
                batch = new[i : i + EMBED_BATCH]
                collection.add(
                    ids=[c.id for c in batch],
                    documents=[c.text for c in batch],
                    embeddings=embedder.embed([c.text for c in batch]),
                    metadatas=[{"source": c.source, SHA_KEY: text_sha256(c.text)} for c in batch],
                )
                indexed += len(batch)
                bar.update(len(batch))
    except Exception as e:  # Chroma reports a full disk as its own error types
        if not _disk_full(e, store_path):
            raise
        where = store_path if store_path is not None else "the store"
        raise StoreError(
            f"disk full while writing the vector index ({indexed} of {len(new)} new chunks indexed, "
            f"no chunk cache written); free space, then run `qcfuse store verify --repair --store "
            f"{where}` and the same ingest again"
        ) from None
    store = engine.caches.store
    disk = getattr(store, "disk", None)
    todo_ids = {c.id for c in plan.todo} - plan.capped
    if plan.todo:
        print(
            f"caching {len(plan.todo) - len(plan.capped)} chunks, {plan.cached_bytes // max(1, plan.bytes_per_token):,} "
            f"tokens: about {_human(plan.cached_bytes)} of KV "
            f"({_human(plan.bytes_per_token)} per token for {engine.adapter.name})",
            file=sys.stderr,
        )
    for c in chunks:  # over the cap: findable in prompts, computed when asked
        if c.id in plan.capped:
            engine.caches.texts.add(c.text, c.id)
    built, not_stored = 0, 0
    with tqdm(total=len(chunks), desc="chunk caches", unit="chunk", disable=not progress) as bar:
        for i in range(0, len(chunks), CACHE_BATCH):
            batch = [c for c in chunks[i : i + CACHE_BATCH] if c.id not in plan.capped]
            if disk is not None and disk.degraded:  # full: what is not stored is computed when asked
                not_stored += sum(1 for c in batch if c.id in todo_ids)
                bar.update(len(chunks[i : i + CACHE_BATCH]))
                continue
            keys = engine.build_chunks([c.text for c in batch], [c.id for c in batch]) if batch else []
            for c, key in zip(batch, keys):
                if c.id in todo_ids:
                    on_disk = disk is None or disk.contains(key)
                    built += on_disk
                    not_stored += not on_disk
            bar.update(len(chunks[i : i + CACHE_BATCH]))
    return {
        "chunks": len(chunks),
        "new_in_chroma": indexed,
        "caches_built": built,
        "caches_not_stored": not_stored,
        "caches_capped": len(plan.capped),
        "index_error": "",
        "disk_full": bool(disk is not None and disk.degraded),
    }


def _confirm_kv(args, plan: KVPlan) -> None:
    """Above `--confirm-above` bytes of KV, ask on a terminal; elsewhere refuse (ValueError)
    unless `--yes`. An estimate past the disk's free space is a warning (the caches that do
    not fit are computed when asked)."""
    total = plan.cached_bytes
    try:
        probe = args.store if args.store.exists() else next(p for p in args.store.parents if p.exists())
        free = shutil.disk_usage(probe).free
    except (OSError, StopIteration):
        free = None
    if free is not None and total > free:
        warn(
            f"this ingest would write about {_human(total)} of KV but {args.store} has {_human(free)} free: "
            "the caches that do not fit are not stored (computed when asked); --max-kv-bytes N caps it"
        )
    if total <= args.confirm_above or args.yes:
        return
    what = (
        f"this ingest would write about {_human(total)} of KV for {len(plan.todo) - len(plan.capped)} "
        f"chunks ({plan.tokens:,} tokens) to {args.store}"
    )
    if sys.stdin is not None and sys.stdin.isatty():
        reply = input(f"{what}; go on? [y/N] ")
        if reply.strip().lower() in ("y", "yes"):
            return
        raise ValueError("ingest cancelled: nothing was written")
    raise ValueError(
        f"{what} (over --confirm-above {_human(args.confirm_above)}); pass --yes to write it, "
        "or --max-kv-bytes N to cache only the first N bytes"
    )


def _collect(
    paths: list[str], max_chars: int, limit: int | None, strict: bool = False, skipped: list[Path] | None = None
) -> list[Chunk]:
    """Text/markdown files and folders are split; QA dataset files (.json/.jsonl in the
    formats `qcfuse_core.eval.datasets` reads) give one chunk per passage. Deduplicated (a file
    listed twice, a folder and a file in it, a repeated paragraph). A file that is not
    UTF-8 text is skipped with a warning naming it (appended to `skipped`), or with
    `strict` raises ValueError."""
    chunks: list[Chunk] = []
    seen: set[str] = set()
    text_paths: list[str | Path] = [p for p in paths if Path(p).suffix.lower() not in DATASET_SUFFIXES]
    for p in paths:
        if Path(p).suffix.lower() in DATASET_SUFFIXES:
            from qcfuse_core.eval.datasets import dataset_name, load_dataset

            for ex in load_dataset(p):
                for passage in ex.passages:
                    c = Chunk(chunk_id(dataset_name(p), passage), passage, dataset_name(p))
                    if c.id not in seen:
                        seen.add(c.id)
                        chunks.append(c)
    for f in dict.fromkeys(p.resolve() for p in iter_text_files(text_paths)):
        if source_name(f) != f.name:
            warn(f"the file name {os.fsencode(_shown(f, text_paths))!r} is not UTF-8; ingested as {source_name(f)!r}")
        try:
            file_chunks = chunks_from_file(f, max_chars)
        except UnicodeDecodeError:
            if strict:
                raise ValueError(f"{_shown(f, text_paths)} is not UTF-8 text (--strict)") from None
            warn(f"{_shown(f, text_paths)} is not UTF-8 text (skipped)")
            if skipped is not None:
                skipped.append(f)
            continue
        for c in file_chunks:
            if c.id not in seen:
                seen.add(c.id)
                chunks.append(c)
    return chunks[:limit] if limit else chunks


def _shown(f: Path, given: list[str | Path]) -> Path:
    """A file as the user would name it: relative to the current folder when given so."""
    if any(Path(g).is_absolute() for g in given):
        return f
    try:
        return f.relative_to(Path.cwd())
    except ValueError:
        return f


def cmd_ingest(args) -> int:
    skipped: list[Path] = []
    chunks = _collect(args.paths, args.chunk_chars, args.limit, args.strict, skipped)
    if not chunks:
        print("nothing to ingest: no .md/.txt files or dataset passages found", file=sys.stderr)
        return 1
    _require_writable(args.store)
    engine = _engine(args, read_only=False)
    chunks = list({c.id: c for c in chunks}.values())
    plan = plan_kv(engine, chunks, args.max_kv_bytes)
    _confirm_kv(args, plan)
    stats = ingest_chunks(engine, _collection(args.store), chunks, plan=plan, store_path=args.store)
    line = (
        f"ingested {stats['chunks']} chunks into {args.store} "
        f"({stats['new_in_chroma']} new in Chroma, {stats['caches_built']} caches built)"
    )
    if stats["caches_capped"]:
        disk = getattr(getattr(engine.caches.store, "disk", None), "capacity_bytes", None)
        cap = (
            f"--max-kv-bytes {_human(args.max_kv_bytes)}"
            if args.max_kv_bytes is not None and (disk is None or args.max_kv_bytes <= disk)
            else f"the store's disk limit of {_human(disk or 0)} (half the disk's room, store/sizing.py)"
        )
        line += f"; {stats['caches_capped']} chunks not cached (over {cap}: computed when asked)"
    if skipped:
        line += f"; skipped {len(skipped)} file{'s' * (len(skipped) != 1)} (not UTF-8 text)"
    print(line)
    if stats["disk_full"]:
        warn(
            f"disk full: {stats['caches_not_stored']} chunk caches were not stored (they are computed "
            "when a question needs them); free space and run the same ingest again to store them"
        )
    return 0


# ---------------------------------------------------------------------------- ask


EMPTY_STORE = "the store is empty: run `qcfuse ingest PATH...` (or `qcfuse demo`) first"


def retrieve(collection, question: str, top_k: int, store: Path | None = None) -> tuple[list[str], list[str]]:
    """The `top_k` nearest documents whose text matches its content hash. A damaged one is
    dropped with a warning and the next candidates fill its place."""
    from qcfuse_core.retrieval.embedder import get_embedder
    from qcfuse_core.retrieval.vector_index import document_ok

    n = collection.count()
    if n == 0:
        raise SystemExit(EMPTY_STORE)
    want = min(top_k, n)
    query = [get_embedder().embed_one(question)]
    k = min(n, want + 4)
    while True:
        res = collection.query(query_embeddings=query, n_results=k, include=["documents", "metadatas"])
        rows = list(zip(res["ids"][0], res["documents"][0], res["metadatas"][0]))
        good = [(i, d) for i, d, m in rows if document_ok(i, d, m)]
        if len(good) >= want or k >= n:
            break
        k = min(n, 2 * k)
    bad = [i for i, d, m in rows if not document_ok(i, d, m)]
    if bad:
        where = f" --store {store}" if store is not None else ""
        warn(
            f"{len(bad)} retrieved chunk(s) do not match their content hash (damaged) and were not used "
            f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); rebuild the vector index with "
            f"`qcfuse store verify --repair{where}`"
        )
    good = good[:want]
    return [i for i, _ in good], [d for _, d in good]


def cmd_ask(args) -> int:
    from qcfuse_core.engine.context import fit_documents

    require_utf8(args.question, "the question")
    if not args.question.strip():
        raise ValueError("the question is empty")
    reader = _reader(args.store)  # read without writing: an empty store fails here, nothing created
    if reader.count() == 0:
        raise SystemExit(EMPTY_STORE)
    engine = _engine(args, read_only=True if args.read_only else None)
    ids, docs = retrieve(reader, args.question, args.top_k, args.store)
    limit = engine.adapter.max_positions or args.max_context
    if args.max_context:
        limit = min(limit, args.max_context)
    if limit:
        fit = fit_documents(engine, args.question, docs, args.max_new_tokens, limit)
        if fit.dropped:
            warn(
                f"dropped {fit.dropped} of {len(docs)} retrieved chunks: the prompt must fit the "
                f"{limit:,}-token context ({fit.prompt_tokens:,} prompt + {args.max_new_tokens} new tokens kept)"
            )
            ids, docs = ids[: fit.kept], docs[: fit.kept]
    kw = dict(method=args.method, ratio=args.ratio, max_new_tokens=args.max_new_tokens, stop=engine.frame.stops)
    if args.json:
        result = engine.answer(args.question, docs, node_ids=ids, **kw)
        print(json.dumps({"question": args.question, **result.to_dict(), "sources": ids}))
        return 0
    stream = engine.stream(args.question, docs, node_ids=ids, **kw)
    for delta in stream:
        print(delta, end="", flush=True)
    r = stream.result
    print(
        f"\n\n[{r.what_answered()}]\nTTFT {r.ttft_ms:.1f} ms, "
        f"total {r.total_ms:.1f} ms, {r.recomputed_tokens}/{r.context_tokens} context tokens recomputed, "
        f"chunk cache {_cache_line(r)}"
    )
    return 0


def _cache_line(r) -> str:
    """'3 hits / 1 miss (built now)': hits had a cache before the question; misses had none
    and were computed while it was answered (TTFT includes that)."""
    line = f"{r.cache_hits} hits / {r.cache_misses} misses"
    return line + (f" ({r.cache_built} built now)" if r.cache_built else "")


# ---------------------------------------------------------------------------- demo


def agreement(full, fused) -> tuple[int, int]:
    """How closely the fused answer follows full prefill's on the same prompt: (answer tokens
    equal position by position, the longer answer's length). (n, n): the same answer."""
    a, b = full.token_ids, fused.token_ids
    return sum(x == y for x, y in zip(a, b)), max(len(a), len(b))


def _fidelity(same: int, total: int) -> str:
    share = same / total if total else 1.0
    whole = "the same answer" if same == total else "a different answer"
    return f"{same}/{total} answer tokens as full prefill's ({share:.0%}), {whole}"


def cmd_demo(args) -> int:
    _require_writable(args.store)
    engine = _engine(args, read_only=False)
    collection = _collection(args.store)
    chunks = demo_chunks()
    stats = ingest_chunks(engine, collection, chunks)
    print(f"sample corpus: {stats['chunks']} chunks ({stats['caches_built']} caches built now) in {args.store}\n")
    method = args.method or engine.config.method
    ratio = engine.config.ratio if args.ratio is None else args.ratio
    kw = dict(max_new_tokens=args.max_new_tokens, stop=engine.frame.stops)
    _, warm_docs = retrieve(collection, DEMO_QUESTIONS[0], args.top_k)
    engine.answer("warm-up", warm_docs, method="full", max_new_tokens=1)
    engine.answer("warm-up", warm_docs, method=method, ratio=ratio, max_new_tokens=1)
    rows = []
    for i, q in enumerate(DEMO_QUESTIONS, 1):
        ids, docs = retrieve(collection, q, args.top_k)
        full = engine.answer(q, docs, node_ids=ids, method="full", **kw)
        fused = engine.answer(q, docs, node_ids=ids, method=method, ratio=ratio, **kw)
        rows.append((full, fused))
        print(f"Q{i}: {q}   ({full.context_tokens} context tokens, {len(docs)} chunks)")
        print(f"  full  | TTFT {full.ttft_ms:7.1f} ms | {full.text.strip()}")
        print(f"  fused | TTFT {fused.ttft_ms:7.1f} ms | {fused.text.strip()}")
        print(f"        | answered by {fused.what_answered()}")
        print(
            f"        | {fused.recomputed_tokens}/{fused.context_tokens} tokens recomputed, "
            f"chunk cache {_cache_line(fused)}"
        )
        print(
            f"        | TTFT speedup {full.ttft_ms / fused.ttft_ms:.2f}x, fidelity: {_fidelity(*agreement(full, fused))}\n"
        )
    tf = sum(r[0].ttft_ms for r in rows) / len(rows)
    tu = sum(r[1].ttft_ms for r in rows) / len(rows)
    agree = [agreement(a, b) for a, b in rows]
    same, total = sum(s for s, _ in agree), sum(t for _, t in agree)
    print(f"mean TTFT: full {tf:.1f} ms, fused {tu:.1f} ms ({tf / tu:.2f}x)")
    print(
        f"fidelity: {same}/{total} answer tokens as full prefill's ({same / max(total, 1):.0%}); "
        f"{sum(s == t for s, t in agree)} of {len(rows)} answers the same"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "question": q,
                        "full": a.to_dict(),
                        "fused": b.to_dict(),
                        "answer_tokens": {"full": a.token_ids, "fused": b.token_ids},
                        "agreement": list(agreement(a, b)),
                    }
                    for q, (a, b) in zip(DEMO_QUESTIONS, rows)
                ],
                indent=2,
            )
        )
    return 0


# ---------------------------------------------------------------------------- main


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        type=Path,
        default=_default_store(),
        metavar="DIR",
        help="folder holding the Chroma collection and the chunk caches; shared by ingest, "
        "ask, demo and store ($QCFUSE_CACHE_DIR/store or ~/.cache/qcfuse/store)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME|DIR",
        help="packaged model name (smollm2-135m, gemma3-270m) or a local Hugging Face model folder "
        "(None: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")


def _answer_opts(p: argparse.ArgumentParser) -> None:
    from qcfuse_core.selection.base import SELECTORS

    p.add_argument(
        "--mode",
        "--method",
        dest="method",
        default=None,
        choices=sorted(SELECTORS),
        help="recompute method (None: the engine's, qcfuse)",
    )
    p.add_argument(
        "--ratio", type=share, default=None, help="share of context tokens to recompute (None: the engine's, 0.15)"
    )
    p.add_argument("--top-k", type=at_least(1), default=4, help="chunks to retrieve")
    p.add_argument("--max-new-tokens", type=at_least(1), default=48, help="tokens to generate at most")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qcfuse")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


# a help text that says its default itself: "(default: %(default)s)", "(default: in words)",
# "(...; default: in words)" - not a choice named "default" ("default: the store ...")
SAYS_DEFAULT = re.compile(r"[(;]\s*default\b")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, said once: a help text that already says
    its default (SAYS_DEFAULT) gets nothing added."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if SAYS_DEFAULT.search(action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qcfuse", description="Query-aware KV cache fusion for RAG.", formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"qcfuse {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "ingest",
        help="chunk, embed and cache text/markdown files, folders or QA dataset files",
        formatter_class=_Formatter,
    )
    p.add_argument("paths", nargs="+", help="files or folders (.md .txt .markdown .rst; .json/.jsonl QA sets)")
    p.add_argument("--chunk-chars", type=at_least(1), default=1200, help="characters per chunk at most")
    p.add_argument("--limit", type=at_least(1), default=None, help="ingest at most N chunks (None: all)")
    p.add_argument("--strict", action="store_true", help="stop at a file that is not UTF-8 text instead of skipping it")
    from qcfuse_core.cli.store import parse_bytes

    p.add_argument("--yes", action="store_true", help="write the KV without asking, however large the estimate")
    p.add_argument(
        "--confirm-above",
        type=parse_bytes,
        default=KV_CONFIRM_BYTES,
        metavar="N",
        help="ask before writing more than N bytes of KV (K, M, G suffixes); without a terminal, refuse unless --yes",
    )
    p.add_argument(
        "--max-kv-bytes",
        type=parse_bytes,
        default=None,
        metavar="N",
        help="cache at most N bytes of KV in this ingest; later chunks are indexed and computed "
        "when asked (None: no cap)",
    )
    _common(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ask", help="answer a question from the store", formatter_class=_Formatter)
    p.add_argument("question", help="the question")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--read-only",
        action="store_true",
        help="never write to the store: answer from what is stored, compute the rest "
        "(automatic when the store is not writable)",
    )
    p.add_argument(
        "--max-context",
        type=at_least(1),
        default=None,
        help="prompt + answer tokens at most (None: the model's context); lower-ranked chunks "
        "that do not fit are dropped with a warning",
    )
    _common(p)
    _answer_opts(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="sample corpus; three questions in full and fused mode", formatter_class=_Formatter)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results to this JSON file")
    _common(p)
    _answer_opts(p)
    p.set_defaults(top_k=8)  # every chunk of the packed sample corpus (5): a ~1.2K-token context
    p.set_defaults(func=cmd_demo)

    from qcfuse_core.cli.store import add_store_commands

    add_store_commands(sub, default_store=_default_store())  # the store ingest, ask and demo share
    from qcfuse_core.cli.quality import add_commands as add_quality_commands

    add_quality_commands(sub)
    from qcfuse_core.eval.ttft import add_commands as add_ttft_commands

    add_ttft_commands(sub)  # `bench ttft`, under `bench` if another module created it
    from qcfuse_core.eval.load_cli import add_commands as add_load_commands

    add_load_commands(sub)  # `bench load`
    from qcfuse_core.eval.routing import add_commands as add_routing_commands

    add_routing_commands(sub)  # `bench routing` (Ray imported only when it runs)
    from qcfuse_core.eval.first_sighting import add_commands as add_first_sighting_commands

    add_first_sighting_commands(sub)  # `bench first-sighting` (against a running server)
    from qcfuse_core.eval.trace_cli import add_commands as add_trace_commands

    add_trace_commands(sub)  # `bench trace` (the openai client against a server, or its app in process)
    from qcfuse_core.studio.cli import add_commands as add_studio_commands

    add_studio_commands(sub)  # `studio` (the web page; FastAPI is imported only when it runs)
    from qcfuse_core.cli.fidelity import add_commands as add_fidelity_commands

    add_fidelity_commands(sub)  # `fidelity`: the audit's report (engine/audit.py)
    from qcfuse_core.serve.cli import add_commands as add_serve_commands

    add_serve_commands(sub)  # `serve` (the OpenAI-compatible server; FastAPI imported only when it runs)
    return parser


def _set_formatter(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command shows its options' defaults in --help."""
    parser.formatter_class = _Formatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                _set_formatter(p)


def _os_error(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from qcfuse_core.store import StoreError

    parser = build_parser()
    _set_formatter(parser)
    args = parser.parse_args(argv)  # every flag checked here (cli/flags.py): before any model loads
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return args.func(args)
    except KeyboardInterrupt:
        print(
            "\nqcfuse: interrupted (the store is consistent: what was finished is kept; "
            "run the same command again to go on)",
            file=sys.stderr,
        )
        return 130
    except (StoreError, ValueError, ImportError) as e:
        print(f"qcfuse: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"qcfuse: error: {_os_error(e)}", file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as e:
        store = getattr(args, "store", None) or "DIR"
        print(
            f"qcfuse: error: a store database is unusable ({e}); run `qcfuse store verify --repair --store {store}`",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
