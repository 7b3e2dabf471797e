"""The figures of docs/determinism.md: same input, same answer, measured through the public API.

    python -m qcfuse_core.eval.determinism --shape llama-3.1-8b --device cuda --out det.json
    python -m qcfuse_core.eval.determinism                     # the embedded model on the CPU

1. ingestion: chunks of mixed lengths prefilled alone and in one batch - how many are the
   same bits (all, by construction: `ingest.prefill_alone`) - and the ingestion rate;
2. repeats: `requests` requests (each `chunks` chunks drawn from a pool, so they share some)
   run one after another, twice, per method through `engine.answer`: identical token ids
   and identical first-token logits; a difference is located (first token or later);
3. the deterministic mode: `batch` of those prompts decoded together in blocks
   (`decode_batch(tile=...)`) against each alone - identical sequences - and the cost of
   the mode: ms per decode step alone and batched, with and without blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.eval.workload import make_workload, open_tier_store
from qcfuse_core.ingest.prefill import prefill_alone, prefill_alone_batch
from qcfuse_core.model.adapter import ModelAdapter, load_model
from qcfuse_core.model.batched import decode_batch, deterministic_tile
from qcfuse_core.model.fusion import KVCache, decode_step, fill_from_hf
from qcfuse_core.model.testing import shaped_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def ingestion(adapter: ModelAdapter, chunk_tokens: int, n: int = 16, seed: int = 0) -> dict[str, Any]:
    """n chunks of mixed lengths (chunk_tokens/8 .. chunk_tokens): alone vs one batch."""
    g = torch.Generator().manual_seed(seed)
    vocab = adapter.shape.vocab_size
    lengths = [int(x) for x in torch.randint(max(1, chunk_tokens // 8), chunk_tokens + 1, (n,), generator=g)]
    chunks = [torch.randint(0, vocab, (m,), generator=g) for m in lengths]
    prefill_alone(adapter, chunks[0])  # warm-up
    _sync(adapter.device)
    t0 = time.perf_counter()
    batched = prefill_alone_batch(adapter, chunks)
    _sync(adapter.device)
    secs = time.perf_counter() - t0
    same = sum(
        _bitwise(k, a[0]) and _bitwise(v, a[1])
        for (k, v), a in zip(batched, (prefill_alone(adapter, c) for c in chunks))
    )
    return {"chunks": n, "lengths": lengths, "identical": same, "tokens_per_s": round(sum(lengths) / secs, 1)}


def repeats(
    engine: QCFuseEngine, requests: list[tuple[str, list[str]]], methods: list[str], ratio: float, max_new_tokens: int
) -> dict[str, Any]:
    """Every request twice, one after another, per method -> identical answers and logits."""
    out: dict[str, Any] = {}
    results: dict[str, list] = {}
    for method in methods:
        runs = [
            [engine.answer(q, docs, method=method, ratio=ratio, max_new_tokens=max_new_tokens) for q, docs in requests]
            for _ in range(2)
        ]
        same_tokens = sum(a.token_ids == b.token_ids for a, b in zip(*runs))
        same_logits = sum(_bitwise(a.first_logits, b.first_logits) for a, b in zip(*runs))
        first_diff = [
            next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            for a, b in zip(*runs)
            if a.token_ids != b.token_ids
        ]
        out[method] = {
            "requests": len(requests),
            "identical_answers": same_tokens,
            "identical_first_logits": same_logits,
            "first_differing_token": first_diff,
            "ttft_ms_median": sorted(r.ttft_ms for r in runs[1])[len(requests) // 2],
        }
        results[method] = runs[0]
    out["_prompts"] = [r.prompt_ids for r in results[methods[0]]]
    return out


def _prefill(adapter: ModelAdapter, ids: list[int], room: int) -> tuple[KVCache, int]:
    logits, kv = adapter.hf_forward(torch.as_tensor(ids), keep=1)
    cache = KVCache(adapter, len(ids) + room)
    fill_from_hf(cache, kv)
    return cache, int(logits[-1].argmax())


def _decode(adapter: ModelAdapter, states: list[tuple[KVCache, int]], steps: int, step_fn) -> tuple[list, float]:
    """Greedy `steps` tokens of every state -> (sequences, ms per step)."""
    caches, seqs = [c for c, _ in states], [[t] for _, t in states]
    _sync(adapter.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = step_fn(caches, [s[-1] for s in seqs])
        for s, row in zip(seqs, logits.argmax(-1).tolist()):
            s.append(int(row))
    _sync(adapter.device)
    return seqs, (time.perf_counter() - t0) * 1e3 / steps


def deterministic_mode(adapter: ModelAdapter, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """`len(prompts)` sequences decoded batched in blocks vs each alone; step costs."""
    tile = deterministic_tile(adapter.device)
    blocked = lambda cs, ts: decode_batch(adapter, cs, ts, tile=tile)  # noqa: E731
    plain_batch = lambda cs, ts: decode_batch(adapter, cs, ts)  # noqa: E731
    plain_alone = lambda cs, ts: decode_step(adapter, cs[0], ts[0])[None]  # noqa: E731
    fresh = lambda: [_prefill(adapter, p, steps + 1) for p in prompts]  # noqa: E731
    _decode(adapter, fresh()[:1], 2, blocked)  # warm-up
    batched, ms_batch_blocked = _decode(adapter, fresh(), steps, blocked)
    alone, ms_alone_blocked = [], []
    for st in fresh():
        seq, ms = _decode(adapter, [st], steps, blocked)
        alone.append(seq[0])
        ms_alone_blocked.append(ms)
    _, ms_batch_plain = _decode(adapter, fresh(), steps, plain_batch)
    plain_seqs, ms_alone_plain = [], []
    for st in fresh():
        seq, ms = _decode(adapter, [st], steps, plain_alone)
        plain_seqs.append(seq[0])
        ms_alone_plain.append(ms)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {
        "batch": len(prompts),
        "tile": tile,
        "steps": steps,
        "identical_batched_vs_alone": sum(a == b for a, b in zip(alone, batched)),
        "plain_batched_equal_to_alone": sum(
            a == b for a, b in zip(plain_seqs, _decode(adapter, fresh(), steps, plain_batch)[0])
        ),
        "ms_per_step": {
            "alone_plain": round(med(ms_alone_plain), 3),
            "alone_deterministic": round(med(ms_alone_blocked), 3),
            "batch_plain": round(ms_batch_plain, 3),
            "batch_deterministic": round(ms_batch_blocked, 3),
        },
    }


def run(
    adapter: ModelAdapter,
    *,
    requests: int,
    chunks: int,
    pool: int,
    chunk_tokens: int,
    max_new_tokens: int,
    batch: int,
    methods: list[str],
    ratio: float,
    seed: int = 0,
    log=print,
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": adapter.name, "device": str(adapter.device), "dtype": str(adapter.dtype)}
    out["ingestion"] = ingestion(adapter, chunk_tokens, seed=seed)
    log("ingestion", json.dumps(out["ingestion"]))
    work = make_workload(adapter.tokenizer, pool, chunk_tokens, 32, 0, seed)
    rng = random.Random(seed)
    reqs = [(work.question + f" ({i})", rng.sample(work.texts, chunks)) for i in range(requests)]
    with tempfile.TemporaryDirectory() as tmp:
        cuda = adapter.device.type == "cuda"
        store = open_tier_store(Path(tmp), "host", 64 << 30 if cuda else 2 << 30, cuda)
        engine = QCFuseEngine(adapter, store=store)
        engine.build_chunks(work.texts, work.node_ids)
        rep = repeats(engine, reqs, methods, ratio, max_new_tokens)
        store.close()
    prompts = rep.pop("_prompts")
    out["repeats"] = rep
    log("repeats", json.dumps(rep))
    out["deterministic"] = deterministic_mode(adapter, prompts[:batch], max_new_tokens)
    log("deterministic", json.dumps(out["deterministic"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qcfuse_core.eval.determinism", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default=None, help="a named shape with random weights (e.g. llama-3.1-8b)")
    p.add_argument("--model", default=None, help="a packaged model or folder (default: the embedded model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--chunks", type=int, default=10, help="chunks per request")
    p.add_argument("--pool", type=int, default=30, help="chunks the requests draw from")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together in the deterministic check")
    p.add_argument("--methods", nargs="+", default=["full", "qcfuse"])
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.shape:
        adapter = shaped_model(args.shape, dtype=dtype, device=args.device, tokenizer=True)
    else:
        adapter = load_model(args.model, dtype=args.dtype, device=args.device)
    res = run(
        adapter,
        requests=args.requests,
        chunks=args.chunks,
        pool=args.pool,
        chunk_tokens=args.chunk_tokens,
        max_new_tokens=args.max_new_tokens,
        batch=min(args.batch, args.requests),
        methods=args.methods,
        ratio=args.ratio,
        log=lambda *a: print(*a, file=sys.stderr, flush=True),
    )
    res["command"] = "python -m qcfuse_core.eval.determinism " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(res, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
