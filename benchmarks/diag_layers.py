"""Critical layers, profiled more thoroughly than the packaged profile (diagnostic).

    python benchmarks/diag_layers.py --dataset ../shared/data/musique/musique_train.json \\
        --offset 60 --limit 16 --ratios 0.15 0.3 --jsonl OUT.jsonl [--sets "8,5,15;6,8"] [--singles]

The packaged SmolLM2-135M profile ranked 8 candidate layers on 2 calibration questions at
0.15. This ranks every layer 1..L-1 (`--singles`) and any layer sets (`--sets`, `;`-separated,
each a comma list; a set scores by the mean of its layers' mass, as the qcfuse selector
does), at each ratio, on more questions, and scores each by two fidelity measures:

- first-token KL(full || fused)  (the issue's criterion);
- excess NLL of full prefill's own greedy answer (nats per token, teacher-forced after the
  fused prompt, minus full prefill's NLL of it): how well the fused cache predicts the whole
  answer full prefill writes, which first-token KL alone has misjudged before.

The query is probed once per question through every layer against the chunks' anchors
(key-norm, the shipped share), so each layer's mass is exactly what the qcfuse selector would
compute with that layer among its critical layers. Records: one per question, variant and
ratio (appended; done question ids skipped). Prints the means per variant at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qcfuse_core import metrics as M  # noqa: E402
from qcfuse_core.anchors import AnchorConfig, ensure_anchors  # noqa: E402
from qcfuse_core.bench_quality import _greedy  # noqa: E402
from qcfuse_core.datasets import load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.fusion import FusedPrompt, KVCache, Segment, fill_from_hf, fused_prefill  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402
from qcfuse_core.probe import context_keys_at, gather_context, query_mass, run_probe  # noqa: E402
from qcfuse_core.scoring import top_budget  # noqa: E402
from qcfuse_core.selectors import SelectionContext  # noqa: E402
from qcfuse_core.store import MemoryStore  # noqa: E402


def run_question(engine: QCFuseEngine, ex, variants: dict[str, list[int]], ratios, max_new: int) -> list[dict]:
    adapter = engine.adapter
    engine.store = MemoryStore()
    prompt, _, _ = engine.fuse_pieces(engine.rag_pieces(ex.question, list(ex.passages)))
    T = prompt.num_tokens
    # full prefill: first-token logits, greedy answer, then its NLL teacher-forced
    logits0, kv0 = adapter.hf_forward(prompt.token_ids, keep=1)
    cache = KVCache(adapter, T + max_new)
    fill_from_hf(cache, kv0)
    cache.length = T
    answer = _greedy(engine, cache, logits0[-1], max_new)
    del kv0, cache
    ans = engine.tokenize(answer)[:max_new] if answer else engine.tokenize(ex.answers[0])[:1]
    G = int(ans.numel())
    prompt_g = FusedPrompt(prompt.segments + [Segment("suffix", ans)])
    full_logits, _ = adapter.hf_forward(prompt_g.token_ids, keep=G + 1)
    full_nll = M.nll(full_logits[:G], ans)
    ans_pos = torch.arange(T, T + G)
    # one probe through every layer that any variant reads
    layers = sorted({layer for ls in variants.values() for layer in ls})
    depth = max(layers) + 1
    acfg = AnchorConfig()
    picks = {id(s): ensure_anchors(adapter, s.chunk, depth, acfg, None)[0]
             for s in prompt.segments if s.kind == "chunk" and s.chunk is not None}
    seg, start = prompt.segments[-1], prompt.starts[-1]
    probe = run_probe(adapter, seg.token_ids, torch.arange(start, start + len(seg)),
                      gather_context(prompt, depth, lambda s: picks[id(s)]), keep=layers)
    per_layer = {}
    for layer, (k_ctx, pos) in zip(layers, context_keys_at(adapter, prompt, layers)):
        m = torch.zeros(T)
        m[pos] = query_mass(probe.q[layer], k_ctx, probe.k[layer], adapter.scale).cpu()
        per_layer[layer] = m
    cand = torch.nonzero(prompt.mask("chunk")).flatten()
    recs = []
    for ratio in ratios:
        ctx = SelectionContext(adapter, prompt, ratio)
        for label, ls in variants.items():
            mass = sum(per_layer[layer] for layer in ls) / len(ls)
            rows = ctx.finalize("diag", top_budget(cand, mass[cand], ctx.budget)).rows
            out = fused_prefill(adapter, prompt_g, torch.cat([rows, ans_pos]), logits_last=G + 1)
            tail = out.logits[-(G + 1):]
            recs.append(dict(id=ex.id, variant=label, layers=ls, ratio=ratio,
                             kl_first_token=M.kl_divergence(logits0[-1], tail[0]),
                             excess_nll=M.nll(tail[:G], ans) - full_nll,
                             top1=float(int(tail[0].argmax()) == int(logits0[-1].argmax())),
                             answer_tokens=G))
    return recs


def summarize(records: list[dict]) -> None:
    by = defaultdict(list)
    for r in records:
        by[(r["variant"], r["ratio"])].append(r)
    ids = {r["id"] for r in records}
    rows = sorted(by.items(), key=lambda kv: (kv[0][1], statistics.mean(r["kl_first_token"] for r in kv[1])))
    print(f"| variant | ratio | n | first-token KL | excess NLL of full's answer | top-1 agree |  ({len(ids)} questions)")
    print("|---|---|---|---|---|---|")
    for (label, ratio), rs in rows:
        print(f"| {label} | {ratio} | {len(rs)} | {statistics.mean(r['kl_first_token'] for r in rs):.4f} | "
              f"{statistics.mean(r['excess_nll'] for r in rs):.4f} | {statistics.mean(r['top1'] for r in rs):.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3])
    ap.add_argument("--singles", action="store_true", help="every layer 1..L-1 alone")
    ap.add_argument("--sets", default="8,5,15", help="';'-separated layer sets (default: the packaged profile)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--summary", action="store_true", help="only print the table of --jsonl")
    a = ap.parse_args()
    out = Path(a.jsonl)
    if a.summary:
        summarize([json.loads(line) for line in out.read_text().splitlines() if line])
        return 0
    torch.set_num_threads(1)
    engine = QCFuseEngine(load_model(dtype="fp32"))
    variants = {}
    if a.singles:
        variants.update({f"L{layer}": [layer] for layer in range(1, engine.adapter.num_layers)})
    for part in filter(None, (p.strip() for p in a.sets.split(";"))):
        ls = [int(x) for x in part.split(",")]
        variants[f"L{'+'.join(map(str, ls))}" if len(ls) > 1 else f"L{ls[0]}"] = ls
    done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line} if out.is_file() else set()
    for ex in load_dataset(a.dataset, limit=a.limit, offset=a.offset):
        if ex.id in done:
            continue
        t0 = time.perf_counter()
        recs = run_question(engine, ex, variants, a.ratios, a.max_new_tokens)
        with out.open("a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"{ex.id}: {time.perf_counter() - t0:.1f} s", flush=True)
    summarize([json.loads(line) for line in out.read_text().splitlines() if line])
    return 0


if __name__ == "__main__":
    sys.exit(main())
