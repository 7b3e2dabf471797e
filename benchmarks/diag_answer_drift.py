"""Why do later answer tokens drift? Selections scored by what the answer attends to (diagnostic).

    python benchmarks/diag_answer_drift.py --dataset ../shared/data/musique/musique_train.json \\
        --limit 12 --ratio 0.15 --jsonl OUT.jsonl

The answer-level metric of `bench quality` (mean per-token KL(full || method) along full
prefill's greedy answer, both caches teacher-forced) grows past the first token. Hypothesis:
the question's attention picks the tokens that decide the first answer token; later tokens
attend to other context tokens (the entity the answer names, the fact beside it) that stay
stale. Per question, at --ratio, every variant recomputes the same number of chunk tokens:

- `qcfuse`: the shipped selection (probe rows = the question suffix).
- `answer-aware` (privileged - needs full's answer): the probe's query rows are the suffix
  followed by full prefill's whole greedy answer, so the ranking sees what the answer attends to.
- `refresh-K` (servable: TTFT unchanged): the first answer token comes from the shipped
  selection; after K answer tokens the probe runs again with the suffix + those K tokens as
  query, and the prompt is fused again with that selection (the same budget, its top tokens
  by the new mass) before token K+1. Teacher-forced along full's answer, as the metric reads.

Per variant: first-token KL, answer-level KL, and that KL split into the first K tokens and
the rest. If `answer-aware` closes most of the later-token drift, the drift is stale context
that the answer (not the question) attends to; if `refresh-K` gets most of that, a refresh in
the first decode steps is a fix that keeps TTFT. Records append to --jsonl (done ids skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qcfuse_core.bench_quality import _greedy_seq, answer_kl, forced_logits  # noqa: E402
from qcfuse_core.datasets import dataset_name, load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.fusion import FusedPrompt, Segment  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402
from qcfuse_core.pipeline import Loading, Planned, Selected  # noqa: E402
from qcfuse_core.selectors import SelectionContext, get_selector  # noqa: E402
from qcfuse_core.store import MemoryStore  # noqa: E402


def select_with_query(engine: QCFuseEngine, prompt: FusedPrompt, extra: list[int], ratio: float) -> Selected:
    """qcfuse's selection with `extra` tokens appended to the probe's query rows -> rows of `prompt`."""
    if not extra:
        return engine.select(prompt, "qcfuse", ratio)
    suffix = prompt.segments[-1]
    longer = FusedPrompt(prompt.segments[:-1] + [Segment("suffix", torch.cat([suffix.token_ids,
                                                                              torch.tensor(extra)]))])
    sel = engine.select(longer, "qcfuse", 0.0)  # the budget below is the original prompt's
    ctx = SelectionContext(engine.adapter, prompt, ratio)
    mass = torch.zeros(longer.num_tokens)
    mass[torch.nonzero(longer.mask("chunk", "text")).flatten()] = sel.selection.scores.float().cpu()
    cand = torch.nonzero(prompt.mask("chunk")).flatten()
    from qcfuse_core.scoring import top_budget

    return Selected(ctx.finalize("qcfuse", top_budget(cand, mass[cand], ctx.budget)))


def variant_logits(engine, loading, selected, seq, capacity) -> torch.Tensor:
    pre = engine.fuse(loading, selected, "qcfuse", capacity=capacity)
    return forced_logits(engine, pre.cache, pre.logits[-1], seq)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--refresh", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--jsonl", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine = QCFuseEngine(load_model(dtype="fp32"))
    out = Path(a.jsonl)
    done = {json.loads(l)["id"] for l in out.read_text().splitlines() if l} if out.is_file() else set()
    for ex in load_dataset(a.dataset, limit=a.limit, offset=a.offset):
        if ex.id in done:
            continue
        t0 = time.perf_counter()
        engine.store = MemoryStore()
        looked = engine.lookup(engine.rag_pieces(ex.question, list(ex.passages)), "naive", streaming=False)
        loading = engine.start_loading(looked, Planned("naive", frozenset()))
        prompt = loading.prompt
        pre = engine.fuse(loading, engine.select(prompt, "full", 1.0), "full", capacity=a.max_new_tokens)
        _, seq, lg = _greedy_seq(engine, pre.cache, pre.logits[-1], a.max_new_tokens, keep_logits=True)
        full = torch.stack(lg)
        del pre
        cap = a.max_new_tokens
        base = engine.select(prompt, "qcfuse", a.ratio)
        kl = {"qcfuse": answer_kl(full, variant_logits(engine, loading, base, seq, cap))}
        kl["answer-aware"] = answer_kl(full, variant_logits(engine, loading, select_with_query(
            engine, prompt, seq, a.ratio), seq, cap))
        for k in a.refresh:
            if k >= len(seq):
                kl[f"refresh-{k}"] = kl["qcfuse"]  # the answer ends before the refresh
                continue
            after = answer_kl(full, variant_logits(engine, loading, select_with_query(engine, prompt, seq[:k], a.ratio),
                                                   seq, cap))
            kl[f"refresh-{k}"] = torch.cat([kl["qcfuse"][:k], after[k:]])  # first k tokens: the shipped cache
        rec = {"id": ex.id, "dataset": dataset_name(a.dataset), "ratio": a.ratio, "answer_tokens": len(seq),
               "kl": {n: [round(float(x), 6) for x in v] for n, v in kl.items()}}
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{ex.id}: {time.perf_counter() - t0:.0f} s " +
              " ".join(f"{n} {float(v.mean()):.4f}" for n, v in kl.items()), flush=True)
    recs = [json.loads(l) for l in out.read_text().splitlines() if l]
    names = list(recs[0]["kl"])
    print(f"| variant (n={len(recs)}, ratio {recs[0]['ratio']}) | first-token KL | answer KL | tokens 1-4 | tokens 5+ |")
    print("|---|---|---|---|---|")
    for n in names:
        first = statistics.mean(r["kl"][n][0] for r in recs)
        ans = statistics.mean(statistics.mean(r["kl"][n]) for r in recs)
        head = statistics.mean(statistics.mean(r["kl"][n][:4]) for r in recs)
        tails = [statistics.mean(r["kl"][n][4:]) for r in recs if len(r["kl"][n]) > 4]
        print(f"| {n} | {first:.4f} | {ans:.4f} | {head:.4f} | {statistics.mean(tails):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
