"""The `qcfuse` command line: ingest, ask, demo (and the store / benchmark tools).

    qcfuse ingest PATH... [--store DIR]     files/folders -> chunks -> Chroma + chunk caches
    qcfuse ask "question" [--store DIR]     retrieve top-k, fuse, answer (--json for one object)
    qcfuse demo [--store DIR]               sample corpus, three questions, full vs fused
    qcfuse store stats|verify|gc|clear      inspect and maintain the chunk store
    qcfuse studio [--store DIR] [--port N]  the web page (qcfuse_core/studio)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
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


def _engine(args):
    from qcfuse_core.engine import EngineConfig, open_engine

    cfg_kw = {}
    if getattr(args, "method", None):
        cfg_kw["method"] = args.method
    if getattr(args, "ratio", None) is not None:
        cfg_kw["ratio"] = args.ratio
    return open_engine(args.store, model=args.model, dtype=args.dtype, device=args.device,
                       config=EngineConfig(**cfg_kw))


def _collection(store: Path):
    from qcfuse_integrations.chroma import open_collection

    return open_collection(store / "chroma")


# ---------------------------------------------------------------------------- ingest


def ingest_chunks(engine, collection, chunks: list[Chunk], progress: bool = True) -> dict:
    """Embed new chunks into Chroma and build their caches. Idempotent."""
    from tqdm import tqdm

    from qcfuse_integrations.embedder import get_embedder

    existing = set(collection.get(ids=[c.id for c in chunks], include=[])["ids"]) if chunks else set()
    new = [c for c in chunks if c.id not in existing]
    embedder = get_embedder()
    for i in range(0, len(new), 64):
        batch = new[i : i + 64]
        collection.add(ids=[c.id for c in batch], documents=[c.text for c in batch],
                       embeddings=embedder.embed([c.text for c in batch]),
                       metadatas=[{"source": c.source} for c in batch])
    built = 0
    for c in tqdm(chunks, desc="chunk caches", unit="chunk", disable=not progress):
        had = engine.store.resolve(c.id) is not None
        engine.build_chunk(c.text, node_id=c.id)
        built += not had
    return {"chunks": len(chunks), "new_in_chroma": len(new), "caches_built": built}


def _collect(paths: list[str], max_chars: int, limit: int | None) -> list[Chunk]:
    """Text/markdown files and folders are split; QA dataset files (.json/.jsonl in the
    formats `qcfuse_core.datasets` reads) give one chunk per passage, deduplicated."""
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
    for f in iter_text_files(text_paths):
        chunks.extend(chunks_from_file(f, max_chars))
    return chunks[:limit] if limit else chunks


def cmd_ingest(args) -> int:
    chunks = _collect(args.paths, args.chunk_chars, args.limit)
    if not chunks:
        print("nothing to ingest: no .md/.txt files or dataset passages found", file=sys.stderr)
        return 1
    engine = _engine(args)
    stats = ingest_chunks(engine, _collection(args.store), chunks)
    print(f"ingested {stats['chunks']} chunks into {args.store} "
          f"({stats['new_in_chroma']} new in Chroma, {stats['caches_built']} caches built)")
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
    engine = _engine(args)
    ids, docs = retrieve(_collection(args.store), args.question, args.top_k)
    kw = dict(method=args.method, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
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
    engine = _engine(args)
    collection = _collection(args.store)
    chunks = _collect([str(sample_corpus_dir())], 1200, None)
    stats = ingest_chunks(engine, collection, chunks)
    print(f"sample corpus: {stats['chunks']} chunks ({stats['caches_built']} caches built now) in {args.store}\n")
    method = args.method or engine.config.method
    ratio = engine.config.ratio if args.ratio is None else args.ratio
    kw = dict(max_new_tokens=args.max_new_tokens)
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


def _common(p: argparse.ArgumentParser, store_default: str = "store") -> None:
    p.add_argument("--store", type=Path, default=_default_store(store_default),
                   help="folder holding the Chroma collection and the chunk caches (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="packaged model name (smollm2-135m, gemma3-270m) or a local HF model folder "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cpu")


def _answer_opts(p: argparse.ArgumentParser) -> None:
    from qcfuse_core.selectors import SELECTORS

    p.add_argument("--mode", "--method", dest="method", default=None, choices=sorted(SELECTORS),
                   help="recompute method (default: the engine's, fused)")
    p.add_argument("--ratio", type=float, default=None, help="share of context tokens to recompute")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qcfuse", description="Query-aware KV cache fusion for RAG.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ingest", help="chunk, embed and cache text/markdown files, folders or QA dataset files")
    p.add_argument("paths", nargs="+")
    p.add_argument("--chunk-chars", type=int, default=1200)
    p.add_argument("--limit", type=int, default=None, help="ingest at most N chunks")
    _common(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ask", help="answer a question from the store")
    p.add_argument("question")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _common(p)
    _answer_opts(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="sample corpus; three questions in full and fused mode")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    _common(p, "demo-store")
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    args = build_parser().parse_args(argv)
    if getattr(args, "top_k", 1) < 1:
        raise SystemExit("--top-k must be >= 1")
    try:
        return args.func(args)
    except (ValueError, ImportError, FileNotFoundError) as e:
        print(f"qcfuse: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
