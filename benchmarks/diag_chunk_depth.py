"""Where qcfuse's and the oracle's rows lie inside the chunks of one question, and how stale
each depth of a chunk is (Gemma-3-270M, fp32, CPU): the long-chunk diagnosis of
docs/benchmarks.md ("Long chunks").

    python benchmarks/diag_chunk_depth.py --dataset ../shared/data/musique/musique_s.json 0 1 4

Per question: qcfuse's and the oracle's rows at 0.3 per chunk and by depth inside the chunk
(bins of 100 tokens), the oracle's staleness (normalised |dK|^2 + |dV|^2 summed over layers,
qcfuse_core/oracle.py) averaged over depth bands of every chunk, and the rows both pick.
"""
import argparse

import torch

from qcfuse_core.datasets import load_dataset
from qcfuse_core.engine import QCFuseEngine
from qcfuse_core.model import load_model
from qcfuse_core.oracle import prompt_staleness
from qcfuse_core.store import MemoryStore

BANDS = ((0, 4), (4, 32), (32, 128), (128, 256), (256, 512), (512, None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("index", type=int, nargs="+", help="question indices")
    args = ap.parse_args()
    torch.set_num_threads(1)
    eng = QCFuseEngine(load_model(args.model, dtype="fp32", device="cpu"), store=MemoryStore())
    for idx in args.index:
        ex = load_dataset(args.dataset, limit=1, offset=idx)[0]
        eng.store = MemoryStore()
        prompt, _, _ = eng.fuse_pieces(eng.rag_pieces(ex.question, list(ex.passages)))
        spans = prompt.chunk_spans()
        picks = {m: eng.select(prompt, m, args.ratio).selection.details["positions"] for m in ("qcfuse", "oracle")}
        print(f"question {idx}: {prompt.num_tokens} tokens, chunks (start, length) {[(s, e - s) for s, e in spans]}")
        for name, pos in picks.items():
            per = [int(((pos >= s) & (pos < e)).sum()) for s, e in spans]
            depth = torch.cat([pos[(pos >= s) & (pos < e)] - s for s, e in spans]).float()
            hist = torch.histc(depth, bins=6, min=0, max=600).int().tolist()
            print(f"  {name}: {pos.numel()} rows; per chunk {per}; by depth 0-100, 100-200, ..., 500-600: {hist}")
        st = prompt_staleness(eng.adapter, prompt)[0]  # the oracle computed it already
        for s, e in spans:
            print(f"  staleness, chunk at {s}, depth bands {BANDS}:",
                  [round(float(st[s + a : s + (b if b is not None else e - s)].mean()), 1) for a, b in BANDS])
        print(f"  rows both pick: {len(set(picks['qcfuse'].tolist()) & set(picks['oracle'].tolist()))}")


if __name__ == "__main__":
    main()
