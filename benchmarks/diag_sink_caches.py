"""Chunk caches prefilled after a one-token attention sink (diagnostic, first-token KL only).

    python benchmarks/diag_sink_caches.py --model gemma3-270m \\
        --dataset ../shared/data/musique/musique_train.json --join 4 --limit 8 --jsonl OUT.jsonl

The engine caches a chunk alone at positions 0..n-1, so its first token is where the model
builds an attention sink; in the fused prompt those entries are the stalest of all (the
reason the Gemma profile's position prior recomputes chunk starts first).
`EngineConfig(chunk_sink=True)` prefills every chunk after the tokenizer's BOS token, which
is then dropped: the cache still depends on the chunk alone, but no chunk token was ever a
sequence start. For each question, naive, epic, cacheblend and qcfuse rankings run on both
kinds of cache (`alone:` and `sink:` keys; two engines over one model), against full
prefill's first token. One JSON line per question.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diag_ranking_grid import emit, grid_args, joined, kl_row  # noqa: E402

from qcfuse_core.datasets import load_dataset  # noqa: E402
from qcfuse_core.engine import EngineConfig, QCFuseEngine  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402
from qcfuse_core.pipeline import Loading  # noqa: E402
from qcfuse_core.store import MemoryStore  # noqa: E402

VARIANTS = [
    "shipped=critical_layers=[5,11,17],position_prior=2,prior_depth=64",
    "pp1_d64=critical_layers=[5,11,17],position_prior=1,prior_depth=64",
    "pp0.5=critical_layers=[5,11,17],position_prior=0.5",
    "noprior=critical_layers=[5,11,17]",
]


def main(argv=None) -> int:
    args, variants, layers = grid_args(__doc__, VARIANTS, argv)
    model = load_model(args.model, dtype="fp32", device="cpu")
    engines = {kind: QCFuseEngine(model, store=MemoryStore(),
                                  config=EngineConfig(selection_options=layers, chunk_sink=kind == "sink"))
               for kind in ("alone", "sink")}
    for ex in load_dataset(args.dataset, limit=args.limit, offset=args.offset):
        passages = joined(ex, args.join)
        row, full = {"id": ex.id}, None
        for kind, eng in engines.items():
            eng.store = MemoryStore()
            prompt, _, _ = eng.fuse_pieces(eng.rag_pieces(ex.question, passages))
            loading = Loading(prompt)
            if full is None:
                full = eng.fuse(loading, eng.select(prompt, "full", 1.0), "full").logits[-1]
                row.update(prompt_tokens=prompt.num_tokens, chunks=len(passages))

            row.update(kl_row(eng, prompt, loading, full, args.ratios, variants, prefix=f"{kind}:"))
        emit(row, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
