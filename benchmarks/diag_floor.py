"""How far full prefill itself moves in bf16: the arithmetic floor of the quality scores (diagnostic).

    python benchmarks/diag_floor.py --dataset ../shared/data/hotpotqa/hotpotqa_train.json \\
        --reference benchmarks/results/quality/reference --jsonl OUT.jsonl \\
        [--compare benchmarks/results/quality/hotpot.records.jsonl]

The quality criteria compare a method with full prefill in fp32. The product runs in bf16 on
a GPU, and the issue notes that bf16 rounding alone changes many of a small model's greedy
answers. This runs full prefill of the same prompt (engine's RAG prompt, gold answer appended
for the teacher-forced NLL, greedy answer) with the model in bf16 and scores it exactly as
`bench quality` scores a method against the fp32 full prefill: first-token KL(fp32 || bf16),
`contains` and the other gold scores, agreement with fp32's answer, gold NLL. The fp32 side
is read from the stored full-prefill references (`bench quality --reference`; computed and
stored when missing), so nothing fp32 is recomputed.

Records: one per question (appended; done ids skipped), `method` "full", `variant`
"full-bf16". At the end it prints, per dataset, bf16 full prefill against fp32 full prefill
beside the methods of `--compare` (committed records), with 95% paired bootstrap intervals
of `contains` minus full's - the same statistic the issue's criteria read.
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

from qcfuse_core import metrics as M  # noqa: E402
from qcfuse_core.bench_quality import (  # noqa: E402
    _greedy,
    _load_reference,
    _reference_key,
    _text_scores,
    reference_path,
    run_example,
)
from qcfuse_core.datasets import dataset_name, load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.fusion import FusedPrompt, KVCache, Segment, fill_from_hf  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402
from merge_quality import read  # noqa: E402  (benchmarks/ is this script's own folder)


def run_question(e32: QCFuseEngine, e16: QCFuseEngine, ex, ref_file: Path, max_new: int, gold_tokens: int = 64) -> dict:
    """bf16 full prefill of one question, scored against the stored fp32 full prefill."""
    prompt, _, _ = e32.fuse_pieces(e32.rag_pieces(ex.question, list(ex.passages)), caches=False)
    gold = e32.tokenize(ex.answers[0])[:gold_tokens]
    G, T = int(gold.numel()), prompt.num_tokens
    prompt_g = FusedPrompt(prompt.segments + [Segment("suffix", gold)])
    key = _reference_key(e32, prompt_g, max_new)
    ref = _load_reference(ref_file, key)
    if ref is None:  # the fp32 reference, as `bench quality --reference` stores it
        run_example(e32, ex, ["full"], [], {}, max_new, gold_tokens=gold_tokens, reference=ref_file)
        ref = _load_reference(ref_file, key)
        assert ref is not None, f"reference for {ex.id} was not written"
    t0 = time.perf_counter()
    logits, kv = e16.adapter.hf_forward(prompt_g.token_ids, keep=G + 1)
    ms = (time.perf_counter() - t0) * 1e3
    cache = KVCache(e16.adapter, T + G + max_new)
    fill_from_hf(cache, kv)
    cache.length = T
    answer = _greedy(e16, cache, logits[0], max_new)
    fp32 = _text_scores(ref["answer"], ex, None)
    return dict(id=ex.id, method="full", variant="full-bf16", ratio=None, prompt_tokens=T,
                kl_first_token=M.kl_divergence(ref["first_logits"], logits[0]), gold_nll=M.nll(logits[:G], gold),
                gold_nll_fp32=ref["gold_nll"], answer_fp32=ref["answer"], contains_fp32=fp32["contains"], ttft_ms=ms,
                **_text_scores(answer, ex, ref["answer"]))


def _ci(diffs: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    x = torch.tensor(diffs, dtype=torch.float64)
    idx = torch.randint(len(x), (n_boot, len(x)), generator=torch.Generator().manual_seed(seed))
    lo, hi = torch.quantile(x[idx].mean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def summarize(floor: list[dict], compare: list[dict]) -> None:
    """bf16 full prefill vs fp32 full prefill, beside the compared methods, per dataset."""
    print("| dataset | run | n | contains - fp32 full's (95% CI) | lost / gained | agree exact | "
          "agree ROUGE-L | first-token KL | gold NLL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sorted({r["dataset"] for r in floor}):
        rows = {r["id"]: r for r in floor if r["dataset"] == name}
        full = {r["id"]: r for r in compare if r["dataset"] == name and r["method"] == "full"}
        bad = [i for i in rows if i in full and full[i]["answer"] != rows[i]["answer_fp32"]]
        if bad:  # the compared records must have been scored against the same fp32 full prefill
            raise SystemExit(f"{name}: committed full answers differ from the references for {bad[:5]}")
        runs: dict[str, dict[str, dict]] = {"full-bf16": rows}
        for r in compare:
            if r["dataset"] == name and r["method"] in ("naive", "qcfuse", "cacheblend", "epic") and r["id"] in rows:
                runs.setdefault(f"{r['method']}@{r['ratio']:g}" if r.get("ratio") is not None else r["method"],
                                {})[r["id"]] = r
        for lab, recs in runs.items():
            ids = sorted(i for i in recs if i in rows)
            base = [rows[i]["contains_fp32"] for i in ids]
            c = [recs[i]["contains"] for i in ids]
            d = [a - b for a, b in zip(c, base)]
            lo, hi = _ci(d)
            lost = sum(a < b for a, b in zip(c, base))
            gained = sum(a > b for a, b in zip(c, base))
            print(f"| {name} | {lab} | {len(ids)} | {statistics.mean(d):+.3f} ({lo:+.3f} to {hi:+.3f}) | "
                  f"{lost} / {gained} | {statistics.mean(recs[i]['agree_exact'] for i in ids):.3f} | "
                  f"{statistics.mean(recs[i]['agree_rouge_l'] for i in ids):.3f} | "
                  f"{statistics.mean(recs[i]['kl_first_token'] for i in ids):.4f} | "
                  f"{statistics.mean(recs[i]['gold_nll'] for i in ids):.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--reference", required=True, help="fp32 full-prefill references (bench quality --reference)")
    ap.add_argument("--jsonl", required=True, help="records, appended")
    ap.add_argument("--compare", nargs="*", default=[], help="committed bench-quality records to print beside")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--summary-only", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.jsonl)
    name = dataset_name(a.dataset)
    if not a.summary_only:
        e32 = QCFuseEngine(load_model(dtype="fp32"))
        e16 = QCFuseEngine(load_model(dtype="bf16"))
        done = {r["id"] for r in read(out) if r.get("dataset") == name}
        for ex in load_dataset(a.dataset, limit=a.limit, offset=a.offset):
            if ex.id in done:
                continue
            t0 = time.perf_counter()
            rec = run_question(e32, e16, ex, reference_path(Path(a.reference), name, ex.id), a.max_new_tokens)
            with out.open("a") as f:
                f.write(json.dumps(dict(rec, dataset=name)) + "\n")
            print(f"{ex.id}: KL {rec['kl_first_token']:.4f} contains {rec['contains']:.0f} "
                  f"(fp32 {rec['contains_fp32']:.0f}) {time.perf_counter() - t0:.1f} s", flush=True)
    compare = [r for p in a.compare for r in read(Path(p)) if r.get("variant") is None]
    summarize([r for r in read(out) if r.get("dataset") == name], compare)
    return 0


if __name__ == "__main__":
    sys.exit(main())
