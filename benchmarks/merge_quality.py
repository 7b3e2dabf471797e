"""Merge a rerun of some methods into the committed quality records.

    python benchmarks/merge_quality.py --old OLD.records.jsonl --new NEW.records.jsonl \\
        --methods qcfuse --keep-old-as qcfuse=qcfuse_rows0 --out MERGED.records.jsonl

A selection change reruns only the changed methods (plus `full`, read back from the stored
full-prefill references); the other methods' records stay valid. The merge keeps every old
record except the rerun methods' (optionally kept under another method name, so the table
shows before and after side by side), adds the new records of the rerun methods, and checks
that the rerun's `full` records reproduce the old ones (same greedy answer, gold NLL within
1e-4 nats) - the other methods were scored against the old ones. Questions the rerun has not
reached yet keep only their old rows; `aggregate` compares methods on common questions.
Exits non-zero if a full-prefill record differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qcfuse_core.bench_quality import merge_rerun  # noqa: E402


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", nargs="+", required=True, type=Path)
    ap.add_argument("--new", nargs="+", required=True, type=Path)
    ap.add_argument("--methods", nargs="+", required=True, help="the rerun methods (their old records are replaced)")
    ap.add_argument("--keep-old-as", nargs="*", default=[], metavar="METHOD=NAME",
                    help="keep a rerun method's old records under another method name")
    ap.add_argument("--new-as", nargs="*", default=[], metavar="METHOD=NAME",
                    help="file a rerun method's new records under another name (an ablation beside it)")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    rename = dict(s.split("=", 1) for s in a.keep_old_as)
    old = [r for p in a.old for r in read(p)]
    new = [r for p in a.new for r in read(p)]
    merged, problems = merge_rerun(old, new, set(a.methods), rename, dict(s.split("=", 1) for s in a.new_as))
    a.out.write_text("".join(json.dumps(r) + "\n" for r in merged))
    n_new = sum(r["method"] == "full" for r in new)
    print(f"{len(merged)} records -> {a.out}; rerun covers {n_new} questions; "
          f"{len(problems)} full-prefill mismatches")
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
