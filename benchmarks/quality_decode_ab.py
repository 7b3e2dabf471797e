"""A/B of `bench quality`'s answer decoding on one question: the plain path (`forced_logits`
then `_greedy_seq`, one method at a time, one token at a time) against `decode_answers`
(shared greedy / forced rows, every method's cache in lockstep), on the same fused caches,
alternating in one process so both see the same machine load. Checks that both give the
same answers and forced logits bit for bit, and prints seconds and decode steps.

    nice -n 19 .venv/bin/python benchmarks/quality_decode_ab.py --dataset ../shared/data/hotpotqa/hotpotqa_train.json \
        [--index 0] [--rounds 2] [--threads 1] [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qcfuse_core import bench_quality as bq
from qcfuse_core import lockstep
from qcfuse_core.datasets import load_dataset
from qcfuse_core.engine import QCFuseEngine
from qcfuse_core.fusion import FusedPrompt, KVCache, Segment
from qcfuse_core.pipeline import Planned
from qcfuse_core.selectors import get_selector
from qcfuse_core.store import MemoryStore

METHODS = ("naive", "oracle", "qcfuse", "adaptive", "cacheblend", "epic")


def _copy(c: KVCache) -> KVCache:
    out = KVCache.__new__(KVCache)
    out.k, out.v, out.length = c.k.clone(), c.v.clone(), c.length
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--index", type=int, default=0, help="question index in the set")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.15, 0.3])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = QCFuseEngine.from_pretrained(args.model, dtype="fp32", device="cpu")
    eng.store = MemoryStore()
    ex = load_dataset(args.dataset, limit=args.index + 1)[args.index]
    loading = eng.start_loading(eng.lookup(eng.rag_pieces(ex.question, list(ex.passages)), "naive", streaming=False),
                                Planned("naive", frozenset()))
    prompt, max_new = loading.prompt, args.max_new_tokens
    gold = eng.tokenize(ex.answers[0])[:64]
    pre = eng.fuse(loading, eng.select(prompt, "full", 1.0), "full", capacity=max_new, teacher=gold)
    _, seq, _ = bq._greedy_seq(eng, pre.cache, pre.logits[0], max_new)
    del pre
    fused = []
    for m in args.methods:
        for r in (args.ratios if get_selector(m).uses_ratio else [None]):
            p = eng.fuse(loading, eng.select(prompt, m, r or 0.0), m, capacity=max_new, teacher=gold)
            fused.append((p.cache, p.logits[0].clone()))
    steps = {"plain": 0, "shared": 0}
    real_step, real_steps = bq.decode_step, lockstep.decode_steps

    def count_one(adapter, cache, token):
        steps["plain"] += 1
        return real_step(adapter, cache, token)

    def count_many(adapter, caches, tokens):
        steps["shared"] += len(tokens)
        return real_steps(adapter, caches, tokens)

    bq.decode_step, lockstep.decode_steps = count_one, count_many
    times: dict[str, list[float]] = {"plain": [], "shared": []}
    same = True
    for _ in range(args.rounds):
        steps.update(plain=0, shared=0)
        t0 = time.perf_counter()
        plain = []
        for cache, first in fused:
            c = _copy(cache)
            rows = bq.forced_logits(eng, c, first, seq)
            ids, _, _ = bq._greedy_seq(eng, c, first, max_new)
            plain.append((ids, rows))
        times["plain"].append(time.perf_counter() - t0)
        caches = [_copy(c) for c, _ in fused]
        t0 = time.perf_counter()
        ids, rows = bq.decode_answers(eng, caches, [f for _, f in fused], seq, max_new)
        times["shared"].append(time.perf_counter() - t0)
        same = same and all(a == b and torch.equal(x, y) for (a, x), b, y in zip(plain, ids, rows))
    print(json.dumps(dict(question=ex.id, prompt_tokens=prompt.num_tokens, variants=len(fused), answer_tokens=len(seq),
                          threads=args.threads, bit_identical=same, decode_tokens=steps,
                          plain_s=[round(t, 2) for t in times["plain"]], shared_s=[round(t, 2) for t in times["shared"]],
                          speedup=round(statistics.median(times["plain"]) / statistics.median(times["shared"]), 2))))


if __name__ == "__main__":
    main()
