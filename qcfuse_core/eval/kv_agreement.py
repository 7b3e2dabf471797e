"""fp8 KV against the model's dtype: do the answers change? (`CacheConfig.kv_dtype`)

    python -m qcfuse_core.eval.kv_agreement --model smollm2-135m --dtype bf16 \\
        --data ../shared/data/musique/musique_s.json ../shared/data/2wikimqa/wikimqa_s_clean.json \\
        --limit 12 --methods qcfuse full --json kv_agreement.json --markdown kv_agreement.md

Each question of each dev set is answered (greedy, `--max-new-tokens`, end of sequence a
token like any other) by three engines on one chunk store: two with KV caches in the model's
dtype, built apart (the "runs"), and one with fp8 KV (e4m3 with a scale per token and KV
head: the fused prefill writes the codes, every decode step reads them; on a CPU the
PyTorch reference path, which quantizes exactly as the GPU kernels do). Per dataset and
method it reports first-token agreement and whole-answer agreement (every token the same)
of fp8 against the first model-dtype run, and of the second model-dtype run against the
first - the noise floor. The rule (docs/design.md, "fp8 KV in the running pool"): fp8
becomes a default only where its agreement is at least 98% of that self-agreement.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone

import torch

RUNS = ("auto", "auto_again", "fp8")  # the engines, in the order they answer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a packaged model (smollm2-135m, gemma3-270m) or a folder")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", nargs="+", required=True, help="dev-set files (eval/datasets.py formats)")
    p.add_argument("--limit", type=int, default=12, help="questions per dataset")
    p.add_argument("--methods", nargs="+", default=["qcfuse"])
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    if a.limit < 1 or a.max_new_tokens < 1:
        p.error("--limit and --max-new-tokens must be positive")
    return a


def _engines(adapter):
    """The three engines of `RUNS` on one chunk store (the chunks are built once)."""
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.engine.config import CacheConfig, EngineConfig
    from qcfuse_core.store import MemoryStore

    store = MemoryStore()
    return {
        run: QCFuseEngine(
            adapter, store=store, config=EngineConfig(cache=CacheConfig(kv_dtype="fp8" if run == "fp8" else "auto"))
        )
        for run in RUNS
    }


def answers(args: argparse.Namespace, adapter, progress=print) -> list[dict]:
    """One record per (dataset, question, method): each run's token ids."""
    from qcfuse_core.eval.datasets import dataset_name, load_dataset

    engines = _engines(adapter)
    records = []
    for path in args.data:
        name = dataset_name(path)
        for ex in load_dataset(path, limit=args.limit):
            for method in args.methods:
                rec: dict = {"dataset": name, "id": ex.id, "method": method}
                t0 = time.perf_counter()
                for run, eng in engines.items():
                    r = eng.answer(
                        ex.question,
                        list(ex.passages),
                        method=method,
                        ratio=args.ratio,
                        max_new_tokens=args.max_new_tokens,
                        ignore_eos=True,
                    )
                    rec[run] = list(r.token_ids)
                records.append(rec)
                progress(f"{name} {ex.id} {method}: {time.perf_counter() - t0:.1f} s, " + _agree_line(rec))
    return records


def _agree_line(rec: dict) -> str:
    a, b, f = rec["auto"], rec["auto_again"], rec["fp8"]
    return f"self {a == b} ({a[:1] == b[:1]}), fp8 {a == f} ({a[:1] == f[:1]})"


def summarize(records: list[dict]) -> list[dict]:
    """Per (dataset, method) and overall: first-token and whole-answer agreement of fp8 and of
    the second model-dtype run with the first, and fp8's share of the self-agreement."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["method"]), []).append(r)
        groups.setdefault(("all", r["method"]), []).append(r)
    rows = []
    for (ds, method), rs in groups.items():
        n = len(rs)

        def share(run: str, first: bool) -> float:
            k = 1 if first else None
            return sum(r["auto"][:k] == r[run][:k] for r in rs) / n

        self_answer, fp8_answer = share("auto_again", False), share("fp8", False)
        row = {
            "dataset": ds,
            "method": method,
            "n": n,
            "self_first": share("auto_again", True),
            "fp8_first": share("fp8", True),
            "self_answer": self_answer,
            "fp8_answer": fp8_answer,
            "fp8_prefix_tokens": sum(_prefix(r["auto"], r["fp8"]) for r in rs) / n,
            "fp8_of_self_answer": fp8_answer / self_answer if self_answer else None,
        }
        rows.append(row)
    return rows


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def markdown(rows: list[dict], max_new: int) -> str:
    lines = [
        f"| dataset | method | n | first token: self / fp8 | {max_new} tokens: self / fp8 | fp8 / self "
        "| fp8 tokens before the first difference |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "-" if r["fp8_of_self_answer"] is None else f"{100 * r['fp8_of_self_answer']:.0f}%"
        lines.append(
            f"| {r['dataset']} | {r['method']} | {r['n']} | {100 * r['self_first']:.0f}% / {100 * r['fp8_first']:.0f}% "
            f"| {100 * r['self_answer']:.0f}% / {100 * r['fp8_answer']:.0f}% | {ratio} | {r['fp8_prefix_tokens']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from qcfuse_core.eval.decode import write_outputs
    from qcfuse_core.model.adapter import load_model

    args = parse_args(argv)
    torch.manual_seed(0)
    adapter = load_model(args.model, dtype=args.dtype, device=args.device)
    records = answers(args, adapter)
    rows = summarize(records)
    out = {
        "rows": rows,
        "records": records,
        "env": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": adapter.name,
            "dtype": args.dtype,
            "device": str(adapter.device),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": " ".join(sys.argv),
        },
    }
    write_outputs(args, out, markdown(rows, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
