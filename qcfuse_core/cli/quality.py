"""CLI commands for selection quality: `qcfuse profile-layers` and `qcfuse bench quality`.

    qcfuse profile-layers --dataset PATH [--model DIR] [--limit N] [--ratio R] [--out FILE]
    qcfuse calibrate-budget --dataset PATH [--limit N] [--shares S...] [--out FILE]
    qcfuse calibrate-guard --dataset PATH [--limit N] [--catch C] [--ratio R] [--out FILE]
    qcfuse bench quality --dataset PATH [PATH...] --methods M... --ratios R... [--limit N]
                         --json OUT [--jsonl RECORDS] [--plot OUT.png] [--aggregate-only]
                         [--reference DIR]

`bench quality` writes the table to OUT, its summary (share of the naive-to-full KL gap
closed and contains against full, each with a 95% paired bootstrap interval over the
questions; scores averaged over the datasets) next to it as
OUT's stem + `.summary.json`, and prints both. With `--guard` the summary also has the
quality guard's catch and escalation rates, and OUT's stem + `.guard.jsonl` holds its record
per question (first-token and answer agreement with full prefill, escalated or not, the
recompute share spent).

`add_commands(subparsers)` registers both on the main parser (qcfuse_core/cli/commands.py).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="packaged model name (smollm2-135m, gemma3-270m) or a local HF folder (default: smollm2-135m)",
    )
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 (agreement metrics need fp32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (None: torch's default)")
    p.add_argument(
        "--chunk-sink",
        action="store_true",
        help="cache every chunk after the tokenizer's BOS token, dropped from the cache "
        "(CacheConfig.chunk_sink: another cache format, with its own keys)",
    )


def _selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--anchors",
        dest="anchor_method",
        default="keynorm",
        choices=("keynorm", "repeat"),
        help="how anchors are picked at ingestion",
    )
    p.add_argument("--anchor-share", type=float, default=0.125, help="share of each chunk's tokens kept as anchors")
    p.add_argument(
        "--critical-layers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated layers (None: the model's profile / preset)",
    )


def add_commands(sub) -> None:
    p = sub.add_parser("profile-layers", help="rank layers for query-aware selection on a calibration set")
    p.add_argument("--dataset", required=True, help="calibration QA set (.json/.jsonl)")
    p.add_argument("--limit", type=int, default=8, help="questions to profile on")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio the profile is made at")
    p.add_argument("--top", type=int, default=3, help="how many layers the profile keeps (greedy: at most)")
    p.add_argument(
        "--search",
        default="singles",
        choices=("singles", "greedy"),
        help="singles: the best layers by their own KL; greedy: grow a set from the best layer, "
        "adding the layer that lowers the set's KL most (~top x the fused prefills, "
        "every example kept in memory)",
    )
    p.add_argument("--out", default=None, help="profile JSON (None: the user profile dir, keyed by fingerprint)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        type=_selection_option,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="ranking options every layer is scored with and the profile keeps, applied with its "
        "layers: position_prior, chunk_sinks (e.g. position_prior=1.5)",
    )
    _model_args(p)
    _selection_args(p)
    p.set_defaults(func=cmd_profile_layers)

    c = sub.add_parser("calibrate-budget", help="calibrate the adaptive budget's target mass to mean recompute shares")
    c.add_argument("--dataset", required=True, help="calibration split (not a reporting set), e.g. musique_train.json")
    c.add_argument("--limit", type=int, default=None, help="questions (default: all)")
    c.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    c.add_argument(
        "--shares",
        nargs="+",
        type=float,
        default=None,
        help="mean recompute shares to calibrate (default: 0.1 0.15 0.2 0.3)",
    )
    c.add_argument(
        "--floor", type=float, default=0.05, help="smallest recompute share the adaptive budget gives a prompt"
    )
    c.add_argument(
        "--ceiling", type=float, default=0.5, help="largest recompute share the adaptive budget gives a prompt"
    )
    c.add_argument("--out", default=None, help="calibration JSON (default: the user calibration dir, by fingerprint)")
    _model_args(c)
    _selection_args(c)
    c.set_defaults(func=cmd_calibrate_budget)

    g = sub.add_parser(
        "calibrate-guard", help="calibrate the quality guard's threshold (first-token margin) for a model"
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="calibration split (not a reporting set), e.g. musique_train.json")
    src.add_argument(
        "--records",
        nargs="+",
        help="`bench quality` per-question records (JSONL) that have qcfuse at --ratio: their first-token "
        "margins and agreement, nothing computed again",
    )
    g.add_argument("--limit", type=int, default=None, help="questions (default: all)")
    g.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    g.add_argument(
        "--catch",
        type=float,
        default=0.9,
        help="share of the questions whose fused first token differs from full prefill's that the "
        "threshold escalates on the split",
    )
    g.add_argument("--ratio", type=float, default=0.15, help="the guarded ratio (the engine's default)")
    g.add_argument("--out", default=None, help="calibration JSON (default: the user guard dir, by fingerprint)")
    _model_args(g)
    g.set_defaults(func=cmd_calibrate_guard)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    q = bsub.add_parser("quality", help="every method on the same prompts vs full prefill and gold")
    q.add_argument("--dataset", nargs="+", required=True, help="QA dataset files (.json/.jsonl)")
    q.add_argument("--methods", nargs="+", default=None, help="methods to compare (None: every method)")
    q.add_argument("--ratios", nargs="+", type=float, default=[0.15, 0.3], help="recompute ratios")
    q.add_argument("--limit", type=int, default=None, help="questions per dataset (None: all)")
    q.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    q.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per answer")
    q.add_argument(
        "--budget",
        default="fixed",
        choices=("fixed", "adaptive"),
        help="fixed: ratio x context rows; adaptive: rows until --target-mass of attention",
    )
    q.add_argument("--target-mass", type=float, default=0.8, help="attention mass the adaptive budget covers")
    q.add_argument("--json", required=True, help="table rows (list of objects)")
    q.add_argument("--jsonl", default=None, help="per-example records, appended (None: JSON path + .records.jsonl)")
    q.add_argument("--plot", default=None, help="also draw the table to this PNG")
    q.add_argument(
        "--option",
        action="append",
        default=[],
        type=_selection_option,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="selection options for the query-aware methods (QCFuseOptions), e.g. deviation_pool=2; "
        "recorded with each of their records",
    )
    q.add_argument(
        "--reference",
        default=None,
        metavar="DIR",
        help="keep full prefill's outputs per question here and reuse them on reruns "
        "(a rerun of other methods then skips full prefill)",
    )
    q.add_argument(
        "--storage",
        default="auto",
        choices=("auto", "bf16", "fp16", "fp8"),
        help="chunk caches round-trip through this storage dtype's codec before fusing (the store's "
        "`storage_dtype`; selection reads the exact caches, as a store's probe sidecar); "
        "records are named METHOD:STORAGE",
    )
    q.add_argument(
        "--guard",
        action="store_true",
        help="also score the quality guard per question (qcfuse at the engine's ratio, escalated up its "
        "ladder where the first-token margin is below the model's threshold; the ratios it needs are added): "
        "its catch and escalation rates go into the summary",
    )
    q.add_argument(
        "--pareto",
        default=None,
        metavar="OUT.png",
        help="plot answer agreement with full prefill against mean recompute share (fixed ratios, the guard)",
    )
    q.add_argument("--aggregate-only", action="store_true", help="only rebuild --json/--plot from --jsonl")
    _model_args(q)
    _selection_args(q)
    q.set_defaults(func=cmd_bench_quality)


def _selection_option(text: str) -> dict:
    from qcfuse_core.selection.options import parse_selection_options

    try:
        return parse_selection_options(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--option {text!r}: {e}") from e


def _open(args):
    import torch

    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.engine.config import CacheConfig, EngineConfig
    from qcfuse_core.model.adapter import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(cache=CacheConfig(chunk_sink=args.chunk_sink))
    return QCFuseEngine(load_model(args.model, dtype=args.dtype, device=args.device), config=config)


def _options(args) -> dict:
    opts = {"anchor_method": args.anchor_method, "anchor_share": args.anchor_share}
    if args.critical_layers:
        opts["critical_layers"] = args.critical_layers
    for k in ("budget", "target_mass"):
        if getattr(args, k, None) is not None:
            opts[k] = getattr(args, k)
    for extra in getattr(args, "option", None) or []:
        opts.update(extra)
    return opts


def cmd_profile_layers(args) -> int:
    from qcfuse_core.eval.profile_layers import format_ranking, profile_layers
    from qcfuse_core.selection import profiles as critical_layers
    from qcfuse_core.selection.anchors import AnchorConfig

    logging.getLogger("qcfuse_core").setLevel(logging.INFO)
    engine = _open(args)
    prof = profile_layers(
        engine,
        args.dataset,
        limit=args.limit,
        ratio=args.ratio,
        top_k=args.top,
        anchors=AnchorConfig(args.anchor_method, args.anchor_share),
        layers=args.critical_layers,
        search=args.search,
        options={k: v for o in args.option for k, v in o.items()},
    )
    path = critical_layers.save_profile(prof, Path(args.out) if args.out else None, engine.adapter)
    print(format_ranking(prof))
    print(f"critical layers {prof['layers']} -> {path}")
    return 0


def cmd_calibrate_budget(args) -> int:
    from qcfuse_core.eval import calibration

    logging.getLogger("qcfuse_core").setLevel(logging.INFO)
    engine = _open(args)
    opts = {"anchor_method": args.anchor_method, "anchor_share": args.anchor_share}
    if args.critical_layers:
        opts["critical_layers"] = args.critical_layers
    cal = calibration.calibrate(
        engine,
        args.dataset,
        shares=tuple(args.shares or calibration.DEFAULT_SHARES),
        limit=args.limit,
        offset=args.offset,
        floor=args.floor,
        ceiling=args.ceiling,
        options=opts,
    )
    path = calibration.save_calibration(cal, Path(args.out) if args.out else None, engine.adapter)
    print("mean share  target mass  mean share at target")
    for s, t in cal["targets"].items():
        print(f"{float(s):>10.3f}  {t:>11.4f}  {cal['mean_share_at_target'][s]:>20.4f}")
    print(f"{cal['n']} questions -> {path}")
    return 0


def cmd_calibrate_guard(args) -> int:
    from qcfuse_core.engine.guard import save_calibration
    from qcfuse_core.eval import guard_calibration

    logging.getLogger("qcfuse_core").setLevel(logging.INFO)
    engine = _open(args)
    if args.records:
        records = [json.loads(x) for f in args.records for x in Path(f).read_text().splitlines() if x.strip()]
        margins = guard_calibration.margins_from_records(records, args.ratio)
        if args.limit is not None:
            margins = margins[args.offset : args.offset + args.limit]
        names = " ".join(Path(f).name for f in args.records)
        cal = guard_calibration.entry(
            engine.adapter, margins, args.catch, args.ratio, f"qcfuse calibrate-guard --records {names}", 0.0
        )
    else:
        cal = guard_calibration.calibrate(
            engine, args.dataset, catch=args.catch, ratio=args.ratio, limit=args.limit, offset=args.offset
        )
    path = save_calibration(cal, Path(args.out) if args.out else None, engine.adapter.fingerprint())
    print(
        f"threshold {cal['threshold']:g} (first-token margin): catches {cal['catch_rate']} of the "
        f"{cal['disagree']} disagreeing questions, escalates {cal['escalation_rate']} of {cal['n']} -> {path}"
    )
    return 0


def cmd_bench_quality(args) -> int:
    from qcfuse_core.eval import quality as bq

    out = Path(args.json)
    jsonl = Path(args.jsonl) if args.jsonl else out.with_suffix(".records.jsonl")
    engine = _open(args) if args.guard or not args.aggregate_only else None
    if not args.aggregate_only:
        assert engine is not None
        logging.getLogger("qcfuse_core").setLevel(logging.INFO)
        methods, ratios = args.methods or list(bq.DEFAULT_METHODS), args.ratios
        if args.guard:
            methods, ratios = bq.guard_methods(methods, ratios, bq.guard_settings(engine))
        for ds in args.dataset:
            bq.run(
                engine,
                ds,
                methods,
                ratios,
                limit=args.limit,
                offset=args.offset,
                options=_options(args),
                max_new=args.max_new_tokens,
                jsonl=jsonl,
                reference=Path(args.reference) if args.reference else None,
                storage=args.storage,
            )
    if not jsonl.is_file():
        raise FileNotFoundError(f"no per-example records at {jsonl}")
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    if args.guard:  # the guard's records, derived from the per-ratio ones with this model's threshold
        assert engine is not None
        records = bq.with_guard(records, bq.guard_settings(engine))
    rows = bq.aggregate(records)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(bq.format_table(rows))
    summary = bq.summarize(rows, records)
    guarded = [r for r in records if r["method"] == bq.GUARDED_LABEL]
    if guarded:
        summary["guard"] = bq.guard_summary(records, guarded[0]["ratio"])
        keys = bq.GUARD_RECORD_KEYS
        per_request = "".join(json.dumps({k: r.get(k) for k in keys}) + "\n" for r in guarded)
        out.with_name(out.stem + ".guard.jsonl").write_text(per_request)
    out.with_name(out.stem + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print()
    print(bq.format_summary(summary))
    if guarded:
        print()
        print(bq.format_guard(summary["guard"]))
    if args.pareto:
        from qcfuse_core.eval.plot import plot_pareto

        plot_pareto(rows, Path(args.pareto))
    if args.plot:
        from qcfuse_core.eval.plot import plot_quality

        plot_quality(rows, Path(args.plot))
    return 0
