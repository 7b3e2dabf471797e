"""Scoring aggregations and prefix-visible chunk caches on a calibration split (diagnostic).

    python benchmarks/diag_scoring.py --set rows --dataset ../shared/data/musique/musique_train.json \\
        --offset 12 --limit 24 --target full --jsonl OUT.jsonl
    python benchmarks/diag_scoring.py --set prefix --dataset ... --offset 12 --limit 24 --jsonl OUT.jsonl

qcfuse averages the probed attention over heads and over every suffix row. `--set rows`
(target full: teacher-forces full prefill's own answer) and `--set rows2` (target gold) try
other aggregations at 0.15 and 0.3: the last 8 / 1 / 16 suffix rows (`QCFuseOptions.query_rows`),
half all rows + half the last 8 (`mix`), max over heads then mean over rows (`headmax`), the
mean of the square roots of the probabilities (`sqrt`), and `qcall` (every layer, no anchors).
`--set prefix` builds every chunk cache once alone (the engine's ingestion) and once with
the prompt prefix (system prompt + header) visible before the chunk, and runs naive and
qcfuse on both; `--set prefix-rows` runs `last8` and `mix` on prefix-visible caches
(pv-last8, pv-mix); `--set prefix-dev` runs the shipped scoring and `deviation_pool=2` on
prefix-visible caches (pv-base, pv-dev2); `--set prefix-eval` runs naive and the shipped qcfuse on
prefix-visible caches only (pv-naive, pv-qcfuse@r; for a reporting set, beside its committed
records). `--set cross` (first token only, no generation, prints a table, no
records) crosses caches and selections at 0.3: alone or prefix-visible caches, each fused with
the tokens qcfuse selects on alone or on prefix-visible caches. `--set blend|blend2|blend3`
rank by attended x stale: `qcblend` (layers 0-1 for every token as cacheblend, then the
budget by probed mass x layer-1 V deviation), `qcblend-pool2` (layers 0-1 for the top 2 x
budget by mass only; the same algorithm as the package option `deviation_pool=2`, run as
`dev2`), and `qcfuse-full2` (qcfuse's pick with layers 0-1 refreshed for every token).
`--set prior` ranks by mass x (1 + position inside the chunk)^-a (`QCFuseOptions(position_prior=a)`,
a = 0.5 and 0.8).
The aggregations, prefix-visible caches and the blend selectors live in this script only
(they patch the selector's scoring, the engine's chunk prefill and the selector registry);
nothing here changes the package's behaviour. Full prefill comes from --reference files when
they exist. Prints the means per variant and the paired comparison with the shipped scoring.
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

import qcfuse_core.selectors as S  # noqa: E402
from qcfuse_kernels.reference import _expand_kv  # noqa: E402
from qcfuse_core.bench_quality import reference_path, run_example  # noqa: E402
from qcfuse_core.datasets import dataset_name, load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402

_shipped_mass = S.query_mass
_mode = {"aggregation": "base"}


def _probs(q, k_ctx, k_query, scale):
    """(H, S, N) softmax probabilities of every query row over [context ; query] keys, context part."""
    N, rows = k_ctx.shape[0], q.shape[0]
    keys = torch.cat([k_ctx, k_query.to(k_ctx.dtype)]).float()
    kf = _expand_kv(keys, q.shape[1] // keys.shape[1]).transpose(0, 1)
    logits = torch.matmul(q.float().transpose(0, 1), kf.transpose(1, 2)) * scale
    visible = torch.arange(N + rows)[None, :] <= torch.arange(N, N + rows)[:, None]
    return torch.softmax(logits.masked_fill(~visible[None], float("-inf")), -1)[..., :N]


def _mass(q, k_ctx, k_query, scale, last=0):
    m = _mode["aggregation"]
    if m == "base":
        return _shipped_mass(q, k_ctx, k_query, scale, last=last)
    p = _probs(q, k_ctx, k_query, scale)
    if m == "mix":
        return 0.5 * p.mean((0, 1)) + 0.5 * p[:, -8:].mean((0, 1))
    if m == "headmax":
        return p.amax(0).mean(0)
    if m == "sqrt":
        return p.sqrt().mean((0, 1))
    raise ValueError(f"unknown aggregation {m!r}")


S.query_mass = _mass
_shipped_select = S.QCFuseSelector.select


def _select(self, ctx):
    _mode["aggregation"] = ctx.options.get("aggregation", "base")
    try:
        return _shipped_select(self, ctx)
    finally:
        _mode["aggregation"] = "base"


S.QCFuseSelector.select = _select


def _probe_prompt(prompt):
    """The prompt the query probe reads: without run_example's appended gold segment."""
    from qcfuse_core.fusion import FusedPrompt

    if len(prompt.segments) >= 2 and prompt.segments[-2].kind == "suffix":  # [... question ; gold]
        return FusedPrompt(prompt.segments[:-1])
    return prompt


class QCBlendSelector(S.CacheBlendSelector):
    """Diagnostic: rank chunk tokens by (qcfuse's probed mass) x (cacheblend's layer-1 V
    deviation) - attended *and* stale. Layers 0-1 run for every token, as in cacheblend. Not
    query-aware for run_example (it gets the gold-extended prompt, as cacheblend does); the
    probe reads the question from the prompt without the appended gold segment."""

    name = "qcblend"
    pool = 0  # 0: layers 0-1 for every token (as cacheblend); k: only the top k x budget by mass

    def select(self, ctx):
        prompt = ctx.prompt
        probe_prompt = _probe_prompt(prompt)
        q_ctx = S.SelectionContext(ctx.adapter, probe_prompt, ctx.ratio, options=ctx.options)
        q_sel = S.get_selector("qcfuse").select(q_ctx)
        mass = torch.zeros(prompt.num_tokens)
        mass[torch.nonzero(probe_prompt.mask("chunk", "text")).flatten()] = q_sel.scores.float().cpu()
        chunk_mask = prompt.mask("chunk")
        if self.pool:  # layers 0-1 for the candidates only: the top pool x budget chunk tokens by mass
            cand0 = torch.nonzero(chunk_mask).flatten()
            pool = S.top_budget(cand0, mass[cand0], self.pool * ctx.budget)
            sel = S.SelectionResult(method=self.name, rows=ctx.finalize(self.name, pool).rows, full_layers=0)
        else:
            base = ctx.finalize(self.name, torch.empty(0, dtype=torch.int64))
            sel = S.SelectionResult(method=self.name, rows=base.rows, full_layers=self.check_layer + 1)

        def on_layer_end(state):
            if state.layer != self.check_layer:
                return None
            cur = state.rows.cpu()
            dev = (state.v_fresh.float() - state.v_cached[state.rows].float()).pow(2).sum(dim=(1, 2)).cpu()
            cand = cur[chunk_mask[cur]]
            chosen = S.top_budget(cand, mass[cand] * dev[chunk_mask[cur]], ctx.budget)
            sel.rows = ctx.finalize(self.name, chosen).rows
            return sel.rows

        sel.on_layer_end = on_layer_end
        return sel


class QCBlendPool2(QCBlendSelector):
    """qcblend with layers 0-1 run for the top 2 x budget tokens by mass only (cheap)."""

    name = "qcblend-pool2"
    pool = 2


class QCFuseFull2(S.QCFuseSelector):
    """qcfuse's selection, with layers 0-1 recomputed for every token (cacheblend's refresh)."""

    name = "qcfuse-full2"

    def select(self, ctx):
        sel = super().select(ctx)
        sel.full_layers = 2
        return sel


for _cls in (QCBlendSelector, QCBlendPool2, QCFuseFull2):
    S.SELECTORS[_cls.name] = _cls


def _q(label, ratio, **opts):
    return (f"{label}@{ratio}", "qcfuse", ratio, opts)


SETS = {
    "blend": lambda r: [_q("base", r), (f"qcblend@{r}", "qcblend", r, {}), (f"cacheblend@{r}", "cacheblend", r, {})],
    "blend2": lambda r: [_q("base", r), (f"qcblend@{r}", "qcblend", r, {}),
                         (f"qcblend-pool2@{r}", "qcblend-pool2", r, {}), (f"qcfuse-full2@{r}", "qcfuse-full2", r, {})],
    "blend3": lambda r: [(f"qcblend-pool2@{r}", "qcblend-pool2", r, {}), _q("dev2", r, deviation_pool=2),
                         (f"qcfuse-full2@{r}", "qcfuse-full2", r, {})],
    "rows": lambda r: [_q("base", r), _q("last8", r, query_rows=8), _q("last1", r, query_rows=1),
                       _q("headmax", r, aggregation="headmax"), _q("sqrt", r, aggregation="sqrt"),
                       (f"qcall@{r}", "qcall", r, {})],
    "prior": lambda r: [_q("base", r), _q("pos0.5", r, position_prior=0.5), _q("pos0.8", r, position_prior=0.8)],
    "rows2": lambda r: [_q("base", r), _q("last8", r, query_rows=8), _q("mix", r, aggregation="mix"),
                        _q("last16", r, query_rows=16)],
}


def prefix_visible(engine: QCFuseEngine, sink: int | None = None) -> dict:
    """Patch engine.prefill_alone: chunks are prefilled after the prompt prefix (switchable);
    with `sink`, after only its first `sink` tokens (a generic attention sink, not the prompt)."""
    prefix_ids = engine.tokenize(engine._head + engine.config.context_header)
    if sink:
        prefix_ids = prefix_ids[:sink]
    full_prefix = engine.tokenize(engine._head + engine.config.context_header)  # the prompt's own prefix piece
    alone = engine.prefill_alone
    state = {"on": False}

    def prefill(ids):
        if state["on"] and not torch.equal(ids, full_prefix):
            k, v = alone(torch.cat([prefix_ids, ids]))
            P = len(prefix_ids)
            return k[:, P:].contiguous(), v[:, P:].contiguous()
        return alone(ids)

    engine.prefill_alone = prefill
    return state


def cross(engine: QCFuseEngine, examples, ratio: float) -> None:
    """First-token KL(full || fused) for {alone, prefix-visible caches} x {selection made on either}."""
    from qcfuse_core import metrics as M
    from qcfuse_core.fusion import fused_prefill
    from qcfuse_core.selectors import SelectionContext, get_selector
    from qcfuse_core.store import MemoryStore

    pv = prefix_visible(engine)
    names = {False: "alone", True: "prefix-visible"}
    kls: dict[tuple[bool, bool], list[float]] = defaultdict(list)
    overlap = []
    for ex in examples:
        pieces = engine.rag_pieces(ex.question, list(ex.passages))
        prompts = {}
        for on in (False, True):
            pv["on"] = on
            engine.store = MemoryStore()
            prompts[on], _, _ = engine.fuse_pieces(pieces)
        full, _ = engine.adapter.hf_forward(prompts[False].token_ids, keep=1)
        rows = {on: get_selector("qcfuse").select(SelectionContext(engine.adapter, prompts[on], ratio)).rows
                for on in (False, True)}
        overlap.append(len(set(rows[False].tolist()) & set(rows[True].tolist())) / rows[False].numel())
        for cache_on in (False, True):
            for sel_on in (False, True):
                out = fused_prefill(engine.adapter, prompts[cache_on], rows[sel_on], logits_last=1)
                kls[(cache_on, sel_on)].append(M.kl_divergence(full[-1], out.logits[-1]))
        print(f"{ex.id}: " + ", ".join(f"{names[c]} caches + {names[s_]} selection {v[-1]:.4f}"
                                       for (c, s_), v in kls.items()), flush=True)
    print(f"| caches | selection made on | first-token KL at {ratio} (n = {len(overlap)}) |")
    print("|---|---|---|")
    for (c, s_), v in kls.items():
        print(f"| {names[c]} | {names[s_]} caches | {statistics.mean(v):.4f} |")
    print(f"rows shared by the two selections: {statistics.mean(overlap):.2f}")


def summarize(records: list[dict]) -> None:
    by = defaultdict(dict)
    for r in records:
        by[r["id"]][r.get("variant", r["method"])] = r
    labels = list(dict.fromkeys(k for d in by.values() for k in d))
    ids = [i for i, d in by.items() if all(lab in d for lab in labels)]
    print("| variant | n | first-token KL | NLL of the target | agree exact | agree ROUGE-L | lower KL than the reference |")
    print("|---|---|---|---|---|---|---|")
    for lab in labels:
        rs = [by[i][lab] for i in ids]
        # each variant against the shipped scoring at its ratio (base@r), pv-X against X
        ref = lab[3:] if lab.startswith("pv-") else ("base@" + lab.split("@")[1] if "@" in lab else None)
        wins = "-"
        if ref in labels and ref != lab:
            wins = f"{sum(by[i][lab]['kl_first_token'] < by[i][ref]['kl_first_token'] for i in ids)}/{len(ids)}"
        print(f"| {lab} | {len(rs)} | {statistics.mean(r['kl_first_token'] for r in rs):.4f} | "
              f"{statistics.mean(r['gold_nll'] for r in rs):.4f} | {statistics.mean(r['agree_exact'] for r in rs):.3f} | "
              f"{statistics.mean(r['agree_rouge_l'] for r in rs):.3f} | {wins} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--set", required=True, choices=sorted(SETS) + ["prefix", "prefix-rows", "prefix-dev", "prefix-eval", "cross"])
    ap.add_argument("--ratio", type=float, default=0.3, help="--set cross only")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--target", default="gold", choices=("gold", "full"))
    ap.add_argument("--reference", default=None, help="full-prefill reference folder (target gold only)")
    ap.add_argument("--jsonl", default=None, help="records, appended (every set but cross)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--sink", type=int, default=None,
                    help="--set prefix*: chunks see only the prefix's first N tokens (a generic sink)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine = QCFuseEngine(load_model(dtype="fp32"))
    if a.set == "cross":
        cross(engine, load_dataset(a.dataset, limit=a.limit, offset=a.offset), a.ratio)
        return 0
    if not a.jsonl:
        ap.error("--jsonl is required")
    out = Path(a.jsonl)
    done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line} if out.is_file() else set()
    name = dataset_name(a.dataset)
    pv = prefix_visible(engine, a.sink) if a.set.startswith("prefix") else None
    if a.set in ("prefix-rows", "prefix-dev", "prefix-eval"):
        pv["on"] = True
    for ex in load_dataset(a.dataset, limit=a.limit, offset=a.offset):
        if ex.id in done:
            continue
        t0 = time.perf_counter()
        ref = reference_path(Path(a.reference), name, ex.id) if a.reference else None
        if a.set == "prefix-eval":  # every cache prefix-visible; full prefill needs none
            variants = [("pv-naive", "naive", None, {})] + [(f"pv-qcfuse@{r}", "qcfuse", r, {}) for r in (0.15, 0.3)]
            recs = run_example(engine, ex, None, None, {}, a.max_new_tokens, variants=variants, target=a.target,
                               reference=ref)
        elif a.set in ("prefix-rows", "prefix-dev"):  # every cache prefix-visible; full prefill needs none
            pick = SETS["rows2"](0.15)[1:3] + SETS["rows2"](0.3)[1:3] if a.set == "prefix-rows" else \
                [_q(lab, r, **o) for r in (0.15, 0.3) for lab, o in (("base", {}), ("dev2", {"deviation_pool": 2}))]
            variants = [("pv-" + lab, m, ratio, o) for lab, m, ratio, o in pick]
            recs = run_example(engine, ex, None, None, {}, a.max_new_tokens, variants=variants, target=a.target,
                               reference=ref)
        elif pv is None:
            variants = SETS[a.set](0.15) + SETS[a.set](0.3)
            recs = run_example(engine, ex, None, None, {}, a.max_new_tokens, variants=variants, target=a.target,
                               reference=ref)
        else:
            recs = []
            for on in (False, True):
                pv["on"] = on
                for r in run_example(engine, ex, ["full", "naive", "qcfuse"], [0.15, 0.3], {}, a.max_new_tokens,
                                     target=a.target, reference=ref):
                    if on and r["method"] == "full":
                        continue
                    r["variant"] = ("pv-" if on else "") + r["method"] + (f"@{r['ratio']}" if r["ratio"] else "")
                    recs.append(r)
        with out.open("a") as f:
            for r in recs:
                f.write(json.dumps(dict(r, dataset=name)) + "\n")
        print(f"{ex.id}: {time.perf_counter() - t0:.1f} s", flush=True)
    summarize([json.loads(line) for line in out.read_text().splitlines() if line])
    return 0


if __name__ == "__main__":
    sys.exit(main())
