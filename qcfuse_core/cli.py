"""The `qcfuse` command line: ingest, ask, demo (and the store / benchmark tools).

    qcfuse ingest PATH... [--store DIR]     files/folders -> chunks -> Chroma + chunk caches
    qcfuse ask "question" [--store DIR]     retrieve top-k, fuse, answer (--json for one object)
    qcfuse demo [--store DIR]               sample corpus, three questions, full vs fused
    qcfuse store stats|verify|gc|clear      inspect and maintain the chunk store
    qcfuse studio [--store DIR] [--port N]  the web page (qcfuse_core/studio)

Every failure a user can cause (a bad file, a read-only or damaged store, a full disk, a
prompt past the model's context) ends in a one-line `qcfuse: error: ...` naming the fix and
a non-zero exit status, or in a warning and a normal answer - never in a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

from qcfuse_core.corpus import (
    DATASET_SUFFIXES,
    Chunk,
    chunk_id,
    chunks_from_file,
    iter_text_files,
    sample_corpus_dir,
)

DEMO_QUESTIONS = (
    "Who founded the Zephyr Institute, and in which year?",
    "When did the Northern Railway close, and why?",
    "How tall is the Cape Wrayth lighthouse?",
)


def _default_store(name: str = "store") -> Path:
    from qcfuse_core.model import cache_dir

    return cache_dir() / name


def warn(msg: str) -> None:
    print(f"qcfuse: warning: {msg}", file=sys.stderr)


def _engine(args, *, read_only: bool | None = None):
    from qcfuse_core.engine import EngineConfig, open_engine

    cfg_kw = {}
    if getattr(args, "method", None):
        cfg_kw["method"] = args.method
    if getattr(args, "ratio", None) is not None:
        cfg_kw["ratio"] = args.ratio
    return open_engine(args.store, model=args.model, dtype=args.dtype, device=args.device,
                       config=EngineConfig(**cfg_kw), read_only=read_only)


def _tree_writable(path: Path) -> bool:
    """Every folder and file under `path` can be written (what Chroma needs to open it)."""
    if not path.exists():
        return True
    return all(os.access(p, os.W_OK) for p in [path, *path.rglob("*")])


def _collection(store: Path, *, read_only: bool = False):
    """The store's Chroma collection. Read-only (by flag, or when the folder is not
    writable): a private temporary copy is opened, since Chroma writes on open; the store's
    own files are never touched. A damaged index raises StoreError naming the repair."""
    from qcfuse_core.store import StoreError
    from qcfuse_integrations.chroma import open_collection

    path = store / "chroma"
    if (read_only or not _tree_writable(path)) and path.exists():
        tmp = Path(tempfile.mkdtemp(prefix="qcfuse-chroma-ro-"))
        atexit.register(shutil.rmtree, tmp, True)
        shutil.copytree(path, tmp / "chroma", copy_function=shutil.copyfile)
        for q in [tmp / "chroma", *(tmp / "chroma").rglob("*")]:  # the copy is ours to write, whatever the source's modes
            q.chmod(q.stat().st_mode | 0o700 if q.is_dir() else 0o600)
        path = tmp / "chroma"
    try:
        import chromadb.errors as chroma_errors
    except ImportError:
        chroma_errors = None
    try:
        collection = open_collection(path)
        collection.count()
        return collection
    except Exception as e:
        if chroma_errors is None or not isinstance(e, chroma_errors.ChromaError):
            raise
        raise StoreError(f"the vector index at {store / 'chroma'} is unusable ({e}); rebuild it with "
                         f"`qcfuse store verify --repair --store {store}`") from e


def _require_writable(store: Path) -> None:
    from qcfuse_core.store import StoreError, kv_dir, writable

    if not (writable(store) and writable(kv_dir(store)) and _tree_writable(store / "chroma")
            and _tree_writable(store / "chunk_texts.sqlite")):
        raise StoreError(f"the store at {store} is read-only; ingest needs a writable store "
                         "(check its permissions, or pass another --store)")


def kv_bytes_per_token(engine) -> int:
    """Bytes one token's cache takes on disk: L layers x (K, V) x Hkv x D x stored dtype."""
    from qcfuse_core.store.codec import stored_dtype

    shape = engine.adapter.shape
    storage = getattr(getattr(engine.store, "config", None), "storage_dtype", "auto")
    itemsize = stored_dtype(storage, engine.adapter.dtype).itemsize
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * itemsize


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# ---------------------------------------------------------------------------- ingest


EMBED_BATCH = 64
CACHE_BATCH = 8  # chunks per `build_chunks` call: batched prefill, and a progress step


def _disk_full(e: BaseException) -> bool:
    return "disk is full" in str(e) or "No space left" in str(e) or "disk full" in str(e)


def ingest_chunks(engine, collection, chunks: list[Chunk], progress: bool = True) -> dict:
    """Embed new chunks into Chroma and build their caches. Idempotent; a chunk listed twice
    is ingested once. A disk that fills stops the writes (the vector index first, the
    caches after it) and the result says how far each got."""
    from tqdm import tqdm

    from qcfuse_integrations.embedder import get_embedder

    chunks = list({c.id: c for c in chunks}.values())  # one per id, first occurrence's order
    existing = set(collection.get(ids=[c.id for c in chunks], include=[])["ids"]) if chunks else set()
    new = [c for c in chunks if c.id not in existing]
    embedder = get_embedder()
    indexed, index_error = 0, ""
    with tqdm(total=len(new), desc="embedding", unit="chunk", disable=not progress or not new) as bar:
        for i in range(0, len(new), EMBED_BATCH):
            batch = new[i : i + EMBED_BATCH]
            try:
                collection.add(ids=[c.id for c in batch], documents=[c.text for c in batch],
                               embeddings=embedder.embed([c.text for c in batch]),
                               metadatas=[{"source": c.source} for c in batch])
            except Exception as e:  # Chroma reports a full disk as its own error type
                if not _disk_full(e):
                    raise
                index_error = f"disk full after {indexed} of {len(new)} new chunks ({e})"
                break
            indexed += len(batch)
            bar.update(len(batch))
    store = engine.store
    disk = getattr(store, "disk", None)
    todo = [c for c in chunks if not store.contains(engine.chunk_tokens(c.text)[1])]
    todo_ids = {c.id for c in todo}
    if todo:
        tokens = sum(int(engine.chunk_tokens(c.text)[0].numel()) for c in todo)
        per = kv_bytes_per_token(engine)
        print(f"caching {len(todo)} chunks, {tokens:,} tokens: about {_human(tokens * per)} of KV "
              f"({_human(per)} per token for {engine.adapter.name})", file=sys.stderr)
    built, not_stored = 0, 0
    with tqdm(total=len(chunks), desc="chunk caches", unit="chunk", disable=not progress) as bar:
        for i in range(0, len(chunks), CACHE_BATCH):
            batch = chunks[i : i + CACHE_BATCH]
            if disk is not None and disk.degraded:  # full: what is not stored is computed when asked
                not_stored += sum(1 for c in batch if c.id in todo_ids)
                bar.update(len(batch))
                continue
            keys = engine.build_chunks([c.text for c in batch], [c.id for c in batch])
            for c, key in zip(batch, keys):
                if c.id in todo_ids:
                    on_disk = disk is None or disk.contains(key)
                    built += on_disk
                    not_stored += not on_disk
            bar.update(len(batch))
    return {"chunks": len(chunks), "new_in_chroma": indexed, "caches_built": built,
            "caches_not_stored": not_stored, "index_error": index_error,
            "disk_full": bool(index_error) or bool(disk is not None and disk.degraded)}


def _collect(paths: list[str], max_chars: int, limit: int | None, strict: bool = False,
             skipped: list[Path] | None = None) -> list[Chunk]:
    """Text/markdown files and folders are split; QA dataset files (.json/.jsonl in the
    formats `qcfuse_core.datasets` reads) give one chunk per passage. Deduplicated (a file
    listed twice, a folder and a file in it, a repeated paragraph). A file that is not
    UTF-8 text is skipped with a warning naming it (appended to `skipped`), or with
    `strict` raises ValueError."""
    chunks: list[Chunk] = []
    seen: set[str] = set()
    text_paths = [p for p in paths if Path(p).suffix.lower() not in DATASET_SUFFIXES]
    for p in paths:
        if Path(p).suffix.lower() in DATASET_SUFFIXES:
            from qcfuse_core.datasets import dataset_name, load_dataset

            for ex in load_dataset(p):
                for passage in ex.passages:
                    c = Chunk(chunk_id(dataset_name(p), passage), passage, dataset_name(p))
                    if c.id not in seen:
                        seen.add(c.id)
                        chunks.append(c)
    for f in dict.fromkeys(p.resolve() for p in iter_text_files(text_paths)):
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


def _shown(f: Path, given: list[str]) -> Path:
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
    stats = ingest_chunks(engine, _collection(args.store), chunks)
    line = (f"ingested {stats['chunks']} chunks into {args.store} "
            f"({stats['new_in_chroma']} new in Chroma, {stats['caches_built']} caches built)")
    if skipped:
        line += f"; skipped {len(skipped)} file{'s' * (len(skipped) != 1)} (not UTF-8 text)"
    print(line)
    if stats["index_error"]:
        warn(f"vector index: {stats['index_error']}; free space and run the same ingest again")
    if stats["disk_full"]:
        warn(f"disk full: {stats['caches_not_stored']} chunk caches were not stored (they are computed "
             "when a question needs them); free space and run the same ingest again to store them")
    return 0


# ---------------------------------------------------------------------------- ask


def retrieve(collection, question: str, top_k: int) -> tuple[list[str], list[str]]:
    from qcfuse_integrations.embedder import get_embedder

    if collection.count() == 0:
        raise SystemExit("the store is empty: run `qcfuse ingest PATH...` (or `qcfuse demo`) first")
    res = collection.query(query_embeddings=[get_embedder().embed_one(question)],
                           n_results=min(top_k, collection.count()))
    return res["ids"][0], res["documents"][0]


def cmd_ask(args) -> int:
    from qcfuse_core.context import fit_documents

    if not args.question.strip():
        raise ValueError("the question is empty")
    engine = _engine(args, read_only=True if args.read_only else None)
    read_only = args.read_only or engine.store.disk.read_only
    ids, docs = retrieve(_collection(args.store, read_only=read_only), args.question, args.top_k)
    limit = engine.adapter.max_positions or args.max_context
    if args.max_context:
        limit = min(limit, args.max_context)
    if limit:
        fit = fit_documents(engine, args.question, docs, args.max_new_tokens, limit)
        if fit.dropped:
            warn(f"dropped {fit.dropped} of {len(docs)} retrieved chunks: the prompt must fit the "
                 f"{limit:,}-token context ({fit.prompt_tokens:,} prompt + {args.max_new_tokens} new tokens kept)")
            ids, docs = ids[: fit.kept], docs[: fit.kept]
    kw = dict(method=args.method, ratio=args.ratio, max_new_tokens=args.max_new_tokens, stop=engine.frame_stops)
    if args.json:
        result = engine.answer(args.question, docs, node_ids=ids, **kw)
        print(json.dumps({"question": args.question, **result.to_dict(), "sources": ids}))
        return 0
    stream = engine.stream(args.question, docs, node_ids=ids, **kw)
    for delta in stream:
        print(delta, end="", flush=True)
    r = stream.result
    print(f"\n\n[{r.method}{'' if r.ratio is None else f' @ {r.ratio:.2f}'}] TTFT {r.ttft_ms:.1f} ms, "
          f"total {r.total_ms:.1f} ms, {r.recomputed_tokens}/{r.context_tokens} context tokens recomputed, "
          f"chunk cache {r.cache_hits} hits / {r.cache_misses} misses")
    return 0


# ---------------------------------------------------------------------------- demo


def cmd_demo(args) -> int:
    _require_writable(args.store)
    engine = _engine(args, read_only=False)
    collection = _collection(args.store)
    chunks = _collect([str(sample_corpus_dir())], 1200, None)
    stats = ingest_chunks(engine, collection, chunks)
    print(f"sample corpus: {stats['chunks']} chunks ({stats['caches_built']} caches built now) in {args.store}\n")
    method = args.method or engine.config.method
    ratio = engine.config.ratio if args.ratio is None else args.ratio
    kw = dict(max_new_tokens=args.max_new_tokens, stop=engine.frame_stops)
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
        label = method if fused.ratio is None else f"{method} @ {fused.ratio:.2f}"
        print(f"        | {label}: {fused.recomputed_tokens}/{fused.context_tokens} tokens recomputed, "
              f"chunk cache {fused.cache_hits} hits / {fused.cache_misses} misses, "
              f"TTFT speedup {full.ttft_ms / fused.ttft_ms:.2f}x\n")
    tf = sum(r[0].ttft_ms for r in rows) / len(rows)
    tu = sum(r[1].ttft_ms for r in rows) / len(rows)
    print(f"mean TTFT: full {tf:.1f} ms, fused {tu:.1f} ms ({tf / tu:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"question": q, "full": a.to_dict(), "fused": b.to_dict()} for q, (a, b) in zip(DEMO_QUESTIONS, rows)],
            indent=2))
    return 0


# ---------------------------------------------------------------------------- main


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", type=Path, default=_default_store(), metavar="DIR",
                   help="folder holding the Chroma collection and the chunk caches; shared by ingest, "
                        "ask and demo ($QCFUSE_CACHE_DIR/store or ~/.cache/qcfuse/store)")
    p.add_argument("--model", default=None, metavar="NAME|DIR",
                   help="packaged model name (smollm2-135m, gemma3-270m) or a local Hugging Face model folder "
                        "(None: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")


def _answer_opts(p: argparse.ArgumentParser) -> None:
    from qcfuse_core.selectors import SELECTORS

    p.add_argument("--mode", "--method", dest="method", default=None, choices=sorted(SELECTORS),
                   help="recompute method (None: the engine's, qcfuse)")
    p.add_argument("--ratio", type=float, default=None,
                   help="share of context tokens to recompute (None: the engine's, 0.15)")
    p.add_argument("--top-k", type=int, default=4, help="chunks to retrieve")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate at most")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qcfuse")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qcfuse", description="Query-aware KV cache fusion for RAG.",
                                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"qcfuse {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ingest", help="chunk, embed and cache text/markdown files, folders or QA dataset files",
                       formatter_class=_Formatter)
    p.add_argument("paths", nargs="+", help="files or folders (.md .txt .markdown .rst; .json/.jsonl QA sets)")
    p.add_argument("--chunk-chars", type=int, default=1200, help="characters per chunk at most")
    p.add_argument("--limit", type=int, default=None, help="ingest at most N chunks (None: all)")
    p.add_argument("--strict", action="store_true",
                   help="stop at a file that is not UTF-8 text instead of skipping it")
    _common(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ask", help="answer a question from the store", formatter_class=_Formatter)
    p.add_argument("question", help="the question")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--read-only", action="store_true",
                   help="never write to the store: answer from what is stored, compute the rest "
                        "(automatic when the store is not writable)")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + answer tokens at most (None: the model's context); lower-ranked chunks "
                        "that do not fit are dropped with a warning")
    _common(p)
    _answer_opts(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="sample corpus; three questions in full and fused mode",
                       formatter_class=_Formatter)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results to this JSON file")
    _common(p)
    _answer_opts(p)
    p.set_defaults(func=cmd_demo)

    from qcfuse_core.store.cli import add_store_commands

    add_store_commands(sub)
    from qcfuse_core.quality_cli import add_commands as add_quality_commands

    add_quality_commands(sub)
    from qcfuse_core.bench_ttft import add_commands as add_ttft_commands

    add_ttft_commands(sub)  # `bench ttft`, under `bench` if another module created it
    from qcfuse_core.studio.cli import add_commands as add_studio_commands

    add_studio_commands(sub)  # `studio` (the web page; FastAPI is imported only when it runs)
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
    args = parser.parse_args(argv)
    if getattr(args, "top_k", 1) < 1:
        raise SystemExit("--top-k must be >= 1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return args.func(args)
    except KeyboardInterrupt:
        print("\nqcfuse: interrupted (the store is consistent: what was finished is kept; "
              "run the same command again to go on)", file=sys.stderr)
        return 130
    except (StoreError, ValueError, ImportError) as e:
        print(f"qcfuse: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"qcfuse: error: {_os_error(e)}", file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as e:
        print(f"qcfuse: error: a store database is unusable ({e}); run `qcfuse store verify --store DIR`",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
