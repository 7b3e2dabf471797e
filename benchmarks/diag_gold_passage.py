"""Does qcfuse recompute the passage that holds the answer? Selection-only diagnostic (CPU, fp32).

    .venv/bin/python benchmarks/diag_gold_passage.py --dataset ../shared/data/hotpotqa/hotpotqa_train.json \
        --records benchmarks/results/quality/hotpot.records.jsonl --ratio 0.3 [--rest 20] --json OUT.json

For every question: the engine's RAG prompt, qcfuse's selection at --ratio (no generation),
and per chunk the share of its tokens selected and of the probed attention mass it receives.
A chunk is a *gold chunk* when its text contains a normalised gold alias. With --records
(a `bench quality` records file) questions are split by whether qcfuse@ratio lost `contains`
against full prefill (full's answer contains the gold, qcfuse's does not). Prints, per group,
the mean selected share of gold chunks vs the others and their mean mass share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from qcfuse_core import metrics as M  # noqa: E402
from qcfuse_core.datasets import load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.selectors import SelectionContext, get_selector  # noqa: E402
from qcfuse_core.store import MemoryStore  # noqa: E402


def lost_ids(records: Path, ratio: float) -> set[str]:
    by: dict[str, dict] = {}
    for line in records.read_text().splitlines():
        r = json.loads(line)
        by.setdefault(r["id"], {})[(r["method"], r["ratio"])] = r
    return {i for i, g in by.items() if ("full", None) in g and ("qcfuse", ratio) in g
            and g[("full", None)]["contains"] > g[("qcfuse", ratio)]["contains"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--records", default=None)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rest", type=int, default=None, help="with --records: every lost question, and only the first N others")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine = QCFuseEngine.from_pretrained(None, dtype="fp32", device="cpu")
    lost = lost_ids(Path(a.records), a.ratio) if a.records else set()
    rows, others = [], 0
    for ex in load_dataset(a.dataset, limit=a.limit):
        if a.rest is not None and ex.id not in lost:
            if others >= a.rest:
                continue
            others += 1
        engine.store = MemoryStore()
        prompt, _, _ = engine.fuse_pieces(engine.rag_pieces(ex.question, list(ex.passages)))
        sel = get_selector("qcfuse").select(SelectionContext(engine.adapter, prompt, a.ratio))
        chosen = torch.zeros(prompt.num_tokens, dtype=torch.bool)
        chosen[sel.rows] = True
        ctx_pos = torch.nonzero(prompt.mask("chunk", "text")).flatten()
        mass = torch.zeros(prompt.num_tokens)
        mass[ctx_pos] = sel.scores.float()
        total = float(mass.sum()) or 1.0
        chunks = []
        for seg, st in zip(prompt.segments, prompt.starts):
            if seg.kind != "chunk":
                continue
            n = len(seg)
            text = engine.tokenizer.decode(seg.token_ids, skip_special_tokens=True)
            chunks.append(dict(tokens=n, gold=bool(M.best(M.contains, text, list(ex.answers))),
                               selected=float(chosen[st:st + n].float().mean()),
                               mass=float(mass[st:st + n].sum()) / total))
        rows.append(dict(id=ex.id, lost=ex.id in lost, chunks=chunks))
        print(ex.id, "lost" if ex.id in lost else "    ",
              " ".join(f"{'G' if c['gold'] else '.'}{c['selected']:.2f}/{c['mass']:.2f}" for c in chunks), flush=True)

    def summary(group):
        g = [c for r in group for c in r["chunks"] if c["gold"]]
        o = [c for r in group for c in r["chunks"] if not c["gold"]]
        mean = lambda xs: round(statistics.mean(xs), 4) if xs else None  # noqa: E731
        return dict(questions=len(group), with_gold_chunk=sum(any(c["gold"] for c in r["chunks"]) for r in group),
                    gold_selected=mean([c["selected"] for c in g]), other_selected=mean([c["selected"] for c in o]),
                    gold_mass=mean([c["mass"] for c in g]), other_mass=mean([c["mass"] for c in o]))

    out = {"ratio": a.ratio, "dataset": a.dataset.rsplit("/", 1)[-1],
           "lost": summary([r for r in rows if r["lost"]]), "rest": summary([r for r in rows if not r["lost"]]),
           "questions": rows}
    print(json.dumps({k: out[k] for k in ("ratio", "lost", "rest")}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
