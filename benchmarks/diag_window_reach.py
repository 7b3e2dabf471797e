"""Where a sliding-window model's first-token error comes from, on one question: which rows
qcfuse picks under a layer set (and how many lie in the last token's window), the KL when a
single chunk or every chunk's first k tokens are recomputed, and the selection bound (oracle)
at a layer set. fp32, CPU, the engine's own select and fuse steps.

    python benchmarks/diag_window_reach.py --model gemma3-270m \
        --dataset ../shared/data/hotpotqa/hotpotqa_train.json --index 3 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from qcfuse_core import metrics as M
from qcfuse_core.datasets import load_dataset
from qcfuse_core.engine import EngineConfig, QCFuseEngine
from qcfuse_core.model import load_model
from qcfuse_core.pipeline import Loading, Selected
from qcfuse_core.store import MemoryStore
from qcfuse_core.types import SelectionResult

LAYER_SETS = ([7, 13, 9], [5, 11, 17])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--index", type=int, default=0, help="question index in the dataset")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--heads", type=int, nargs="+", default=[4, 16, 32, 64], help="k: every chunk's first k tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    deep = sorted({x for s in LAYER_SETS for x in s})
    eng = QCFuseEngine(load_model(args.model, dtype="fp32", device="cpu"), store=MemoryStore(),
                       config=EngineConfig(selection_options={"critical_layers": deep}))
    windows = [w for w in eng.adapter.windows if w is not None]
    window = min(windows) if windows else None
    ex = load_dataset(args.dataset, limit=1, offset=args.index)[0]
    prompt, _, _ = eng.fuse_pieces(eng.rag_pieces(ex.question, list(ex.passages)))
    loading = Loading(prompt)
    T, spans = prompt.num_tokens, prompt.chunk_spans()
    full = eng.fuse(loading, eng.select(prompt, "full", 1.0), "full").logits[-1]
    naive_rows = eng.select(prompt, "naive", 0.0).selection.rows  # the suffix (and what is not cached)

    def kl_sel(selected: Selected, method: str) -> float:
        return round(M.kl_divergence(full, eng.fuse(loading, selected, method).logits[-1]), 5)

    def kl_rows(rows) -> float:
        rows = torch.unique(torch.cat([torch.as_tensor(rows, dtype=torch.long), naive_rows]))
        return kl_sel(Selected(SelectionResult("diag", rows)), "diag")

    out = {"id": ex.id, "prompt_tokens": T, "window": window, "chunks": spans, "ratio": args.ratio,
           "naive": kl_sel(eng.select(prompt, "naive", 0.0), "naive"),
           "epic": kl_sel(eng.select(prompt, "epic", args.ratio), "epic"),
           "cacheblend": kl_sel(eng.select(prompt, "cacheblend", args.ratio), "cacheblend")}
    for layers in LAYER_SETS:
        for prior in (0.0, 2.0):
            sel = eng.select(prompt, "qcfuse", args.ratio, {"critical_layers": layers, "position_prior": prior})
            rows = sel.selection.rows
            out[f"qcfuse {layers} prior {prior}"] = {
                "kl": kl_sel(sel, "qcfuse"), "rows": len(rows),
                "rows_in_last_window": int((rows >= T - window).sum()) if window else None}
        out[f"oracle {layers}"] = kl_sel(eng.select(prompt, "oracle", args.ratio, {"critical_layers": layers}), "oracle")
    out["one chunk whole"] = [kl_rows(torch.arange(s, e)) for s, e in spans]
    out["every chunk's first k"] = {k: kl_rows(torch.cat([torch.arange(s, min(e, s + k)) for s, e in spans]))
                                    for k in args.heads}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
