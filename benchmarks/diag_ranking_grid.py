"""First-token KL of qcfuse ranking variants (critical layers x position prior x chunk sinks)
on one model, question by question: how a profile's layers and options were chosen.

    python benchmarks/diag_ranking_grid.py --model gemma3-270m \
        --dataset ../shared/data/musique/musique_train.json --limit 8 --jsonl OUT.jsonl

One JSON line per question: naive, epic, cacheblend and every variant at 0.15 and 0.3 (fp32, CPU, the
engine's own select and fuse steps, no decoding). Variants are NAME=OPTIONS (the bench's
--option syntax); the default grid is the one the Gemma-3-270M profile was chosen from.
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
from qcfuse_core.selectors import parse_selection_options
from qcfuse_core.store import MemoryStore

GRID = [
    "sliding=critical_layers=[7,13,9]",  # the profile made without a prior (2 questions)
    "full_pp1=critical_layers=[5,11,17],position_prior=1",
    "full_pp1.5=critical_layers=[5,11,17],position_prior=1.5",
    "full_pp2=critical_layers=[5,11,17],position_prior=2",
    "full_pp3=critical_layers=[5,11,17],position_prior=3",
    "l5_11_pp1.5=critical_layers=[5,11],position_prior=1.5",
    "l5_11_pp2=critical_layers=[5,11],position_prior=2",
    "l17_pp1.5=critical_layers=[17],position_prior=1.5",
    "full_pp1.5_sinks4=critical_layers=[5,11,17],position_prior=1.5,chunk_sinks=4",
]


def first_token_kl(eng, prompt, loading, full, method: str, ratio: float, options: dict | None = None) -> float:
    """KL of `method`'s first-token distribution at `ratio` against full prefill's `full`."""
    sel = eng.select(prompt, method, ratio, options)
    return round(M.kl_divergence(full, eng.fuse(loading, sel, method).logits[-1]), 5)


def kl_row(eng, prompt, loading, full, ratios, variants, prefix: str = "") -> dict:
    """First-token KL against `full` of naive, and of epic, cacheblend and every qcfuse
    variant at each ratio: {prefix + "naive": .., prefix + "epic@0.15": .., ...}."""
    def kl(method, ratio, options=None):
        return first_token_kl(eng, prompt, loading, full, method, ratio, options)

    row = {prefix + "naive": kl("naive", 0.0)}
    for ratio in ratios:
        row[f"{prefix}epic@{ratio}"] = kl("epic", ratio)
        row[f"{prefix}cacheblend@{ratio}"] = kl("cacheblend", ratio)
        for name, opts in variants.items():
            row[f"{prefix}{name}@{ratio}"] = kl("qcfuse", ratio, opts)
    return row


def emit(row: dict, jsonl: Path | None) -> None:
    """Print one question's JSON line, and append it to `jsonl` when given."""
    line = json.dumps(row)
    print(line, flush=True)
    if jsonl:
        with jsonl.open("a") as f:
            f.write(line + "\n")


def grid_args(doc: str, default_variants: list[str], argv=None) -> tuple[argparse.Namespace, dict, dict]:
    """The grid diagnostics' command line -> (args, variants: name -> qcfuse options, the
    selection options that probe deep enough for every variant's critical layers). Sets
    torch's threads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3])
    ap.add_argument("--variant", action="append", default=None, help="NAME=KEY=VALUE[,KEY=VALUE] (repeatable)")
    ap.add_argument("--join", type=int, default=1,
                    help="join every K passages into one chunk (longer chunks from a calibration split "
                         "of short ones, e.g. musique_train's ~120-token paragraphs)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jsonl", type=Path, default=None, help="append one line per question here")
    args = ap.parse_args(argv)
    if args.join < 1:
        ap.error("--join must be >= 1")
    torch.set_num_threads(args.threads)
    variants = {}
    for v in args.variant or default_variants:
        name, _, opts = v.partition("=")
        variants[name] = parse_selection_options(opts)
    deepest = sorted({layer for o in variants.values() for layer in o.get("critical_layers", [])})
    return args, variants, {"critical_layers": deepest} if deepest else {}


def joined(ex, k: int) -> list[str]:
    """The question's passages joined k at a time (--join)."""
    return ["\n\n".join(ex.passages[i : i + k]) for i in range(0, len(ex.passages), k)]


def questions(eng, args):
    """Per question of the command line's set -> (row head, prompt, loading, full prefill's
    last logits), each on a fresh store (every chunk cached alone)."""
    for ex in load_dataset(args.dataset, limit=args.limit, offset=args.offset):
        eng.store = MemoryStore()
        passages = joined(ex, args.join)
        prompt, _, _ = eng.fuse_pieces(eng.rag_pieces(ex.question, passages))
        loading = Loading(prompt)
        full = eng.fuse(loading, eng.select(prompt, "full", 1.0), "full").logits[-1]
        yield {"id": ex.id, "prompt_tokens": prompt.num_tokens, "chunks": len(passages)}, prompt, loading, full


def main(argv=None) -> int:
    args, variants, layers = grid_args(__doc__, GRID, argv)
    eng = QCFuseEngine(load_model(args.model, dtype="fp32", device="cpu"), store=MemoryStore(),
                       config=EngineConfig(selection_options=layers))
    for row, prompt, loading, full in questions(eng, args):
        row.update(kl_row(eng, prompt, loading, full, args.ratios, variants))
        emit(row, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
