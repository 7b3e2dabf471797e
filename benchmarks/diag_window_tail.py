"""First-token KL of the shipped qcfuse ranking when the context's last T tokens - those the
final row still reaches at a sliding-window layer - are recomputed first, within the same
budget (T = 0 is the shipped ranking). A diagnostic for long-chunk sets on windowed models:

    python benchmarks/diag_window_tail.py --model gemma3-270m \
        --dataset ../shared/data/musique/musique_train.json --join 5 --limit 10 --jsonl OUT.jsonl

One JSON line per question: naive and tail T at each ratio (fp32, CPU, the engine's own
select and fuse steps, no decoding).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from diag_ranking_grid import emit, first_token_kl, grid_args, questions
from qcfuse_core import selectors
from qcfuse_core.engine import QCFuseEngine
from qcfuse_core.model import load_model
from qcfuse_core.store import MemoryStore

TAILS = (0, 64, 128, 256, 448)


@contextmanager
def tail_first(t: int):
    """Rank the prompt's last t context tokens before every scored token while inside (the
    qcfuse selector looks `selectors.ranking_scores` up at each call, so the swap reaches it)."""
    shipped = selectors.ranking_scores

    def ranked(prompt, mass, opts):
        rank_by = shipped(prompt, mass, opts)
        if t:
            ctx = torch.nonzero(prompt.mask("chunk", "text")).flatten()[-t:]
            rank_by = rank_by.clone()
            rank_by[ctx.to(rank_by.device)] = float("inf")
        return rank_by

    selectors.ranking_scores = ranked
    try:
        yield
    finally:
        selectors.ranking_scores = shipped


def main(argv=None) -> int:
    args, _, _ = grid_args(__doc__, [], argv)
    if args.variant:
        sys.exit("diag_window_tail.py ranks with the shipped profile only; --variant is not taken")
    eng = QCFuseEngine(load_model(args.model, dtype="fp32", device="cpu"), store=MemoryStore())
    for row, prompt, loading, full in questions(eng, args):
        def kl(method, ratio):
            return first_token_kl(eng, prompt, loading, full, method, ratio)

        row["naive"] = kl("naive", 0.0)
        for ratio in args.ratios:
            for t in TAILS:
                with tail_first(t):
                    row[f"tail{t}@{ratio}"] = kl("qcfuse", ratio)
        emit(row, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
