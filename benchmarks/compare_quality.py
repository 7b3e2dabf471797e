"""Do two runs of `bench quality` agree record by record? (a refactor must not move them)

    python benchmarks/compare_quality.py OLD.records.jsonl NEW.records.jsonl

Pairs records by (question id, method, ratio) and prints how many greedy answers are equal
and the largest differences of first-token KL, gold NLL and recompute share. Exits non-zero
if an answer or a recompute share differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from merge_quality import read  # noqa: E402


def keyed(path: str) -> dict:
    return {(r["id"], r["method"], r["ratio"]): r for r in read(Path(path)) if "variant" not in r}


def main(old_path: str, new_path: str) -> int:
    old, new = keyed(old_path), keyed(new_path)
    pairs = [(old[k], r) for k, r in new.items() if k in old]
    if not pairs:
        print("no records in common")
        return 1
    same = sum(o["answer"] == n["answer"] for o, n in pairs)
    share = max(abs(o["recompute_share"] - n["recompute_share"]) for o, n in pairs)
    print(f"questions {len({k[0] for k in new})}, records paired {len(pairs)}, same answer {same}/{len(pairs)}, "
          f"max |d first-token KL| {max(abs(o['kl_first_token'] - n['kl_first_token']) for o, n in pairs):.2e}, "
          f"max |d gold NLL| {max(abs(o['gold_nll'] - n['gold_nll']) for o, n in pairs):.2e}, "
          f"max |d recompute share| {share:.2e}")
    return 0 if same == len(pairs) and share == 0 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
