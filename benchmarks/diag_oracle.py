"""How far is qcfuse's selection from the best selection at its budget? (diagnostic, first token only)

    python benchmarks/diag_oracle.py --dataset ../shared/data/musique/musique_train.json \\
        --offset 12 --limit 12 --jsonl OUT.jsonl

Runs full prefill once through the engine's own layer loop with every row recomputed and
reads, per layer and per context token, what an ordinary prefill knows and a selector cannot:
the deviation of the token's fresh K and V from its cached (chunk-alone) K and V, and the
attention the question's rows really pay it (fresh Q over fresh K). Then it fuses the prompt
with selections ranked by that privileged information and reports first-token KL(full || fused)
beside qcfuse's own selection at the same budget:

- `qcfuse`: the shipped selection (probe against anchors, critical layers).
- `attn-crit` / `attn-all`: true attention mass of the suffix rows (mean over heads and rows) at
  the critical layers / at every layer - what the probe estimates, without its error;
  `attn-crit+sink` also takes every chunk's first token (a spurious sink on alone caches, which
  full prefill does not attend to).
- `dev`: staleness only - the sum over layers of |dK|^2 + |dV|^2, each layer normalised by its
  mean over chunk tokens.
- `mass-x-dev`: qcfuse's probed mass x `dev` (what `deviation_pool` estimates from layer 1);
  `mass-x-dv`: V only; `mass-x-dev-early`: layers 0-2 only; `mass-x-dv1` / `mass-x-dk1` /
  `mass-x-dkv1`: layer 1 only, V / K / both (what a layer-1 check can see; `deviation_pool`
  reads `mass-x-dv1` among its pool).
- `mass-x-posA`: no privileged information - probed mass x (1 + position inside the chunk)^-A,
  a prior for staleness (which falls steeply with the position inside the chunk: printed).
- `attn-x-dv`: sum over layers of true attention x |dV| - a first-order estimate of how much
  the token's staleness moves the question's attention output.

With `--answers` each selection also writes its greedy answer (as `bench quality` decodes:
24 new tokens), scored by `contains` against the gold aliases and by exact agreement with full
prefill's own answer; `--ids` restricts the run to named questions.

If the oracles beat qcfuse by a wide margin, selection is what limits fidelity at this budget;
if they do not, no ranking of tokens will close the gap and the error lies elsewhere. Nothing
here changes the package. Records (one per question) are appended to --jsonl; the table is
printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qcfuse_core import critical_layers  # noqa: E402
from qcfuse_core import metrics as M  # noqa: E402
from qcfuse_core.bench_quality import _greedy  # noqa: E402
from qcfuse_core.datasets import dataset_name, load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.fusion import KVCache, fill_from_hf, fused_prefill  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402
from qcfuse_core.selectors import SelectionContext, chunk_position_prior, get_selector, top_budget  # noqa: E402
from qcfuse_kernels.reference import _expand_kv, apply_rope  # noqa: E402

VARIANTS = ("qcfuse", "attn-crit", "attn-crit+sink", "attn-all", "dev", "mass-x-dev", "mass-x-dv", "mass-x-dev-early",
            "attn-x-dv", "mass-x-dv1", "mass-x-dk1", "mass-x-dkv1", "mass-x-pos0.25", "mass-x-pos0.5", "mass-x-pos0.8")
BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 10**9))  # position inside the chunk


def privileged(engine: QCFuseEngine, prompt) -> dict:
    """Full prefill (every row) -> last-row logits, per-layer deviations and true suffix attention."""
    adapter = engine.adapter
    T = prompt.num_tokens
    suffix_start = prompt.starts[-1]
    qs: dict[int, torch.Tensor] = {}
    ks: dict[int, torch.Tensor] = {}
    qkv = adapter.qkv

    def capture(layer, x):
        q, k, v = qkv(layer, x)
        qs[layer], ks[layer] = q[suffix_start:].float(), k.float()
        return q, k, v

    dk, dv = [], []

    def on_layer_end(state):
        dk.append((state.k_pre_fresh.float() - state.k_pre_cached.float()).pow(2).sum((1, 2)))
        dv.append((state.v_fresh.float() - state.v_cached.float()).pow(2).sum((1, 2)))
        return None

    adapter.qkv = capture
    try:
        out = fused_prefill(adapter, prompt, torch.arange(T), on_layer_end=on_layer_end)
    finally:
        del adapter.qkv  # back to the class method
    cos, sin = adapter.rope(torch.arange(T))
    attn = []
    for layer in range(adapter.num_layers):
        q = apply_rope(qs[layer], cos[suffix_start:], sin[suffix_start:])  # (S, H, D)
        k = apply_rope(ks[layer], cos, sin)  # (T, Hkv, D)
        kf = _expand_kv(k, q.shape[1] // k.shape[1]).transpose(0, 1)  # (H, T, D)
        logits = torch.matmul(q.transpose(0, 1), kf.transpose(1, 2)) * adapter.scale  # (H, S, T)
        visible = torch.arange(T)[None, :] <= torch.arange(suffix_start, T)[:, None]
        p = torch.softmax(logits.masked_fill(~visible[None], float("-inf")), -1)
        attn.append(p.mean((0, 1)))  # (T,)
    return dict(logits=out.logits[-1], attn=torch.stack(attn), dk=torch.stack(dk), dv=torch.stack(dv))


def _norm(d: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """(L, T) per-layer deviations, each layer scaled by its mean over chunk tokens."""
    return d / d[:, chunk].mean(1, keepdim=True).clamp_min(1e-12)


def staleness(priv: dict, chunk: torch.Tensor) -> torch.Tensor:
    """(T,) |dK|^2 + |dV|^2 summed over layers, each layer normalised (`dev`)."""
    return (_norm(priv["dk"], chunk) + _norm(priv["dv"], chunk)).sum(0)


def rankings(priv: dict, probed_mass: torch.Tensor, prompt, crit: list[int]) -> dict[str, torch.Tensor]:
    chunk = prompt.mask("chunk")

    def norm(d):
        return _norm(d, chunk)

    dev = staleness(priv, chunk)
    first_tokens = torch.tensor([s for s, _ in prompt.chunk_spans()])
    sinks = torch.zeros_like(dev)
    sinks[first_tokens] = float("inf")
    return {
        "attn-crit": priv["attn"][crit].mean(0),
        "attn-crit+sink": priv["attn"][crit].mean(0) + sinks,
        "mass-x-dv": probed_mass * norm(priv["dv"]).sum(0),
        "mass-x-dev-early": probed_mass * (norm(priv["dk"]) + norm(priv["dv"]))[:3].sum(0),
        "mass-x-dv1": probed_mass * priv["dv"][1],
        "mass-x-dk1": probed_mass * priv["dk"][1],
        "mass-x-dkv1": probed_mass * (norm(priv["dk"]) + norm(priv["dv"]))[1],
        **{f"mass-x-pos{a}": probed_mass * chunk_position_prior(prompt, a) for a in (0.25, 0.5, 0.8)},
        "attn-all": priv["attn"].mean(0),
        "dev": dev,
        "mass-x-dev": probed_mass * dev,
        "attn-x-dv": (priv["attn"] * priv["dv"].sqrt()).sum(0),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    help="selections to fuse (qcfuse always runs: the others are compared with it)")
    ap.add_argument("--jsonl", required=True, help="records, appended; questions already there are skipped")
    ap.add_argument("--ids", nargs="+", default=None, help="only these question ids (of the offset/limit slice)")
    ap.add_argument("--answers", action="store_true", help="also decode each selection's greedy answer")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine = QCFuseEngine(load_model(dtype="fp32"))
    crit, _ = critical_layers.lookup(engine.adapter)
    out = Path(a.jsonl)
    done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line} if out.is_file() else set()
    for ex in load_dataset(a.dataset, limit=a.limit, offset=a.offset):
        if ex.id in done or (a.ids is not None and ex.id not in a.ids):
            continue
        t0 = time.perf_counter()
        prompt, _, _ = engine.fuse_pieces(engine.rag_pieces(ex.question, list(ex.passages)))
        full_logits, full_kv = engine.adapter.hf_forward(prompt.token_ids, keep=1)
        T = prompt.num_tokens
        priv = privileged(engine, prompt)
        chunk = prompt.mask("chunk")
        cand = torch.nonzero(chunk).flatten()
        in_chunk = torch.full((prompt.num_tokens,), -1)
        for st, en in prompt.chunk_spans():
            in_chunk[st:en] = torch.arange(en - st)
        dev_all = staleness(priv, chunk)
        rec = {"id": ex.id, "dataset": dataset_name(a.dataset), "context_tokens": prompt.context_tokens,
               "kl_all_rows_vs_hf": M.kl_divergence(full_logits[-1], priv["logits"]), "kl": {}, "overlap": {},
               "dev_by_position": {f"{lo}-{hi}": float(dev_all[(in_chunk >= lo) & (in_chunk < hi)].mean())
                                   for lo, hi in BUCKETS}}
        if a.answers:
            cache = KVCache(engine.adapter, T + a.max_new_tokens)
            fill_from_hf(cache, full_kv)
            cache.length = T
            full_answer = _greedy(engine, cache, full_logits[-1], a.max_new_tokens)
            rec.update(answer={"full": full_answer}, contains={"full": M.best(M.contains, full_answer, ex.answers)},
                       agree_exact={})
        del full_kv
        for ratio in a.ratios:
            ctx = SelectionContext(engine.adapter, prompt, ratio)
            sel = get_selector("qcfuse").select(ctx)
            mass = torch.zeros(prompt.num_tokens)
            mass[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = sel.scores.float().cpu()
            rows = {"qcfuse": sel.rows}
            for name, score in rankings(priv, mass, prompt, crit).items():
                rows[name] = ctx.finalize(name, top_budget(cand, score[cand], ctx.budget)).rows
            base = set(sel.rows.tolist())
            for name in dict.fromkeys(["qcfuse"] + a.variants):
                cache = KVCache(engine.adapter, T + a.max_new_tokens) if a.answers else None
                fused = fused_prefill(engine.adapter, prompt, rows[name], logits_last=1, kv_out=cache)
                rec["kl"][f"{name}@{ratio}"] = M.kl_divergence(full_logits[-1], fused.logits[-1])
                if a.answers:
                    cache.length = T
                    ans = _greedy(engine, cache, fused.logits[-1], a.max_new_tokens)
                    rec["answer"][f"{name}@{ratio}"] = ans
                    rec["contains"][f"{name}@{ratio}"] = M.best(M.contains, ans, ex.answers)
                    rec["agree_exact"][f"{name}@{ratio}"] = float(M.normalize(ans) == M.normalize(full_answer))
                rec["overlap"][f"{name}@{ratio}"] = len(base & set(rows[name].tolist())) / len(base)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{ex.id}: {time.perf_counter() - t0:.1f} s " + " ".join(f"{k} {v:.4f}" for k, v in rec["kl"].items()),
              flush=True)
    recs = [json.loads(line) for line in out.read_text().splitlines() if line]
    ans = [r for r in recs if "contains" in r]  # decoded answers (--answers)
    extra = " contains - full's (lost / gained) | agree exact |" if ans else ""
    print(f"| selection | ratio | n | first-token KL | lower KL than qcfuse | rows shared with qcfuse |{extra}")
    print("|---|---|---|---|---|---|" + ("---|---|" if ans else ""))
    for ratio in a.ratios:
        for name in dict.fromkeys(["qcfuse"] + a.variants):
            key = f"{name}@{ratio}"
            kl = [r["kl"][key] for r in recs]
            wins = sum(r["kl"][key] < r["kl"][f"qcfuse@{ratio}"] for r in recs)
            line = (f"| {name} | {ratio} | {len(recs)} | {statistics.mean(kl):.4f} | {wins}/{len(recs)} | "
                    f"{statistics.mean(r['overlap'][key] for r in recs):.2f} |")
            if ans:
                d = [r["contains"][key] - r["contains"]["full"] for r in ans]
                line += (f" {statistics.mean(d):+.3f} ({sum(x < 0 for x in d)} / {sum(x > 0 for x in d)}) | "
                         f"{statistics.mean(r['agree_exact'][key] for r in ans):.3f} |")
            print(line)
    pos = [r for r in recs if not any(math.isnan(v) for v in r["dev_by_position"].values())]
    if pos:
        print(f"mean staleness (dev summed over layers, each layer's chunk mean = 1) by position inside the "
              f"chunk, {len(pos)} questions: " + ", ".join(
                  f"{b} {statistics.mean(r['dev_by_position'][b] for r in pos):.1f}" for b in pos[0]["dev_by_position"]))
    print(f"all-rows engine prefill vs HF forward, max KL: {max(r['kl_all_rows_vs_hf'] for r in recs):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
