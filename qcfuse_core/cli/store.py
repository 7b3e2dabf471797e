"""`qcfuse store ...`: inspect and maintain the KV store of a QCFuse store root.

    qcfuse store stats  [--store DIR] [--json] [--url URL]
    qcfuse store verify [--store DIR] [--remove] [--repair] [--json]
                        [--deep [--sample N] [--model M] [--dtype D] [--device DEV]]
    qcfuse store gc     [--store DIR] --max-bytes N   (N may end in K, M, G or T: powers of 1024)
    qcfuse store clear  [--store DIR] [--yes]

DIR defaults to the store `ingest`, `ask` and `demo` share (`qcfuse` passes its default).
DIR is the store root (it also holds the Chroma collection); the KV store is DIR/kv.
`stats --url URL` asks a running `qcfuse studio` for its store's tiers instead (GET
/api/store): the GPU and host tiers live in the process that serves, and only it can say
what they hold and how often they were hit.
Hook: `add_store_commands(subparsers)` on the main parser's subparsers, then dispatch
`args.command == "store"` (or `args.func`) to `run_store_command(args)`.

It sits above the store: the KV store's maintenance (store/maintenance.py), the chunk-text and
vector indexes (retrieval/indexes.py) and, for `verify --deep`, the drift check
(ingest/drift.py) with the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from qcfuse_core.learn import count_learned, learned_bytes
from qcfuse_core.store.disk import MANIFEST_NAME, DiskTier
from qcfuse_core.store.entry import FORMAT_VERSION
from qcfuse_core.store.maintenance import (
    DEFAULT_GRACE_S,
    cache_files,
    clear,
    gc,
    manifest_problem,
    set_aside_manifest,
    verify,
)
from qcfuse_core.store.manifest import Manifest
from qcfuse_core.store.sizing import disk_tier_bytes
from qcfuse_core.store.tier_report import TIER_FIELDS, tier_lines
from qcfuse_core.store.tiered import kv_dir, writable
from qcfuse_core.types import ChunkKey

__all__ = ["add_store_commands", "kv_dir", "parse_bytes", "run_store_command"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1048576', '512M', '10G' -> bytes (powers of 1024)."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in _UNITS and s[-1:] else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1000000, 512M, 10G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"byte size must be >= 0, got {text!r}")
    return int(value * _UNITS[unit])


def add_store_commands(
    subparsers: argparse._SubParsersAction, *, default_store: Path | None = None
) -> argparse.ArgumentParser:
    """Register `store {stats,verify,gc,clear}` on the main CLI's subparsers.

    `--store DIR` is required unless `default_store` is given (the CLI's default root)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    store = subparsers.add_parser("store", help="inspect and maintain the KV chunk store", formatter_class=fmt)
    sub = store.add_subparsers(dest="store_command", required=True)

    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--store",
            required=default_store is None,
            default=default_store,
            type=Path,
            metavar="DIR",
            help="store root (the KV store lives in DIR/kv)",
        )
        p.add_argument("--json", action="store_true", help="print a JSON object")
        p.set_defaults(func=run_store_command)
        return p

    st = common(sub.add_parser("stats", help="entries, bytes and node links on disk; tiers", formatter_class=fmt))
    st.add_argument(
        "--url",
        default=None,
        help="a running `qcfuse studio` (e.g. http://127.0.0.1:8501): its store's tiers - occupancy, hits, "
        "misses, hit rate and evictions of the GPU, host and disk tiers - instead of the folder's disk tier",
    )
    v = common(
        sub.add_parser(
            "verify",
            formatter_class=fmt,
            help="check every KV entry, sidecar and node link, the chunk-text index and the vector index",
        )
    )
    v.add_argument(
        "--remove", action="store_true", help="delete bad, stale and orphaned files (never a file that verifies)"
    )
    v.add_argument(
        "--repair",
        action="store_true",
        help="index intact entries again (after a lost manifest) and rebuild a damaged "
        "chunk-text or vector index from the other",
    )
    v.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        help="leave orphan files younger than this many seconds alone (live writers)",
    )
    v.add_argument(
        "--deep",
        action="store_true",
        help="also recompute stored caches with the model and compare them bit for bit (drift; loads the model)",
    )
    v.add_argument(
        "--sample", type=_positive_int, default=None, metavar="N", help="with --deep: recompute N random entries"
    )
    v.add_argument("--model", default=None, metavar="NAME|DIR", help="with --deep: the model (default: embedded)")
    v.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="with --deep: model dtype")
    v.add_argument("--device", default="cpu", help="with --deep: torch device")
    g = common(
        sub.add_parser("gc", help="shrink the store to a byte budget (least recently used first)", formatter_class=fmt)
    )
    g.add_argument(
        "--max-bytes",
        required=True,
        type=parse_bytes,
        metavar="N",
        help="byte budget for the entries (K, M, G, T suffixes: powers of 1024)",
    )
    g.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        help="leave orphan files younger than this many seconds alone (live writers)",
    )
    c = common(sub.add_parser("clear", help="remove every entry", formatter_class=fmt))
    c.add_argument("--yes", action="store_true", help="do it (without this, nothing is removed)")
    store.set_defaults(func=run_store_command)
    return store


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def _emit(args: argparse.Namespace, obj: dict, lines: list[str]) -> None:
    out = json.dumps(obj, indent=2) if args.json else "\n".join(lines)
    sys.stdout.write(out + "\n")


def run_store_command(args: argparse.Namespace) -> int:
    """Run one `store` subcommand; returns the process exit code."""
    if args.store_command == "stats" and getattr(args, "url", None):
        return _live_stats(args)
    root = kv_dir(args.store)
    problem = manifest_problem(root / MANIFEST_NAME)
    files = cache_files(root) if problem else 0
    if problem == "missing" and not files:
        sys.stderr.write(f"no KV store at {root} (nothing has been ingested there)\n")
        return 1
    verifying = args.store_command == "verify"
    if problem and not verifying:
        sys.stderr.write(
            f"qcfuse: error: the KV manifest {root / MANIFEST_NAME} is {problem} ({files} cache files "
            f"are on disk); rebuild it with `qcfuse store verify --repair --store {args.store}`\n"
        )
        return 2
    changes = args.store_command in ("gc", "clear") or (verifying and (args.remove or args.repair))
    if changes and not writable(root):
        sys.stderr.write(
            f"qcfuse: error: the KV store at {root} is read-only; `store {args.store_command}` needs to write there\n"
        )
        return 2
    args.manifest_problem = problem
    if problem and args.repair and problem != "missing":
        set_aside_manifest(root / MANIFEST_NAME)  # kept as manifest.sqlite.bad-<time>
    disk = DiskTier(root, read_only=not changes or bool(problem and not args.repair))
    if problem and not args.repair:  # read nothing from a damaged manifest: every file is unindexed
        disk.manifest.close()
        disk.manifest = Manifest(root / ".no-manifest", read_only=True)
    try:
        return _COMMANDS[args.store_command](args, disk)
    finally:
        disk.close()


def _stats(args: argparse.Namespace, disk: DiskTier) -> int:
    groups: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    for row in disk.manifest.entries():
        g = groups[(row.format_version, row.storage)]
        g[0] += 1
        g[1] += row.nbytes
    total = sum(b for _, b in groups.values())
    sidecars = disk.manifest.sidecars()
    index = Path(args.store) / "chunk_texts.sqlite"
    learned = (*count_learned(index), learned_bytes(index))
    obj: dict = {
        "path": str(disk.root),
        "format_version": FORMAT_VERSION,
        "entries": sum(n for n, _ in groups.values()),
        "bytes": total,
        "sidecars": len(sidecars),
        "sidecar_bytes": sum(s.nbytes for s in sidecars),
        "nodes": disk.manifest.num_nodes(),
        "learned_texts": learned[0],
        "learned_chars": learned[1],
        "learned_bytes": learned[2],
        "by_storage": [
            {"format_version": v, "storage": s, "entries": n, "bytes": b, "usable": v == FORMAT_VERSION}
            for (v, s), (n, b) in sorted(groups.items())
        ],
    }
    # the disk tier as the tier table shows it; lookups are counted by the process that serves
    cap = disk_tier_bytes(disk.root, total)  # what a process opening the store bounds it to by default
    disk_row = {f: None for f in TIER_FIELDS} | {
        "entries": obj["entries"],
        "bytes_used": total,
        "capacity_bytes": cap,
        "occupancy": total / cap if cap else None,
    }
    obj["tiers"] = {"disk": disk_row}
    lines = [
        f"KV store {disk.root}  (format v{FORMAT_VERSION})",
        f"  entries {obj['entries']}  bytes {total:,}  sidecars {len(sidecars)}  nodes {obj['nodes']}",
        f"  learned {learned[0]} texts ({learned[1]:,} characters, {learned[2]:,} bytes of caches)",
    ]
    for g in obj["by_storage"]:
        flag = "" if g["usable"] else "  (stale: another format version; `store gc` removes it)"
        lines.append(f"  v{g['format_version']} {g['storage']:>5}: {g['entries']} entries, {g['bytes']:,} bytes{flag}")
    lines += ["", *("  " + line for line in tier_lines(obj["tiers"]))]
    lines += [
        "",
        "  entries   chunk caches (one per distinct chunk text and model); bytes: their files",
        "  sidecars  small per-chunk files the query probe reads first (anchors, critical-layer keys)",
        "  nodes     links from a framework's node id to its chunk cache (one per node and model)",
        "  learned   chunk texts `qcfuse serve` learned from prompts (their caches are among the entries)",
        "  v<N> <storage>: entries by format version and stored dtype (auto: the model's dtype)",
        "  tiers     the GPU and host tiers, and hits, live in the process that serves: --url URL asks it",
    ]
    _emit(args, obj, lines)
    return 0


def _live_stats(args: argparse.Namespace) -> int:
    """`stats --url URL`: the tiers of the store a running studio holds (GET URL/api/store)."""
    import httpx

    url = args.url.rstrip("/") + "/api/store"
    try:
        res = httpx.get(url, timeout=10.0)
    except httpx.HTTPError as e:
        sys.stderr.write(f"qcfuse: error: {url}: {type(e).__name__}: {e}\n")
        return 2
    if res.status_code != 200:
        sys.stderr.write(f"qcfuse: error: {url} answered {res.status_code}: {res.text[:200]}\n")
        return 2
    obj = res.json()
    table = obj.get("tiers", {})
    lines = [f"KV store of {args.url} ({obj.get('backend', '?')} store; counted since it started)"]
    lines += ["  " + line for line in tier_lines(table)] if table else ["  (no tiers: an in-memory store)"]
    _emit(args, obj, lines)
    return 0


def _verify(args: argparse.Namespace, disk: DiskTier) -> int:
    from qcfuse_core.retrieval import indexes

    rep = verify(disk, remove=args.remove, repair=args.repair, grace_s=args.grace_s)
    links = disk.manifest.node_links()
    entries = {r.chunk_key for r in disk.manifest.entries()}
    dangling = sum(1 for _, key in links if key not in entries)
    idx = indexes.check(Path(args.store), {node for node, _ in links})
    if args.repair and idx.bad:
        indexes.repair(Path(args.store), idx)
        done = idx.repaired
        idx = indexes.check(Path(args.store), {node for node, _ in links})
        idx.repaired = done
    problem = getattr(args, "manifest_problem", "")
    lines = []
    if problem:
        lines.append(
            f"KV manifest {disk.root / MANIFEST_NAME}: "
            + (
                f"was {problem}; rebuilt from the cache files' headers"
                if args.repair
                else f"BAD: {problem}; its cache files are listed as unindexed below"
            )
        )
    lines.append(
        f"checked {rep.checked} entries: {rep.ok} ok, {len(rep.bad)} bad, "
        f"{len(rep.stale)} stale, {len(rep.unindexed)} unindexed, {len(rep.orphans)} orphan files"
    )
    lines += [f"  bad {k}: {why}" for k, why in rep.bad]
    lines.append(f"node links: {len(links)} ({dangling} to a cache that is gone: computed again when asked)")
    for name, st in (("chunk-text index", idx.chunk_texts), ("vector index", idx.chroma)):
        state = f"BAD: {st.problem}" if not st.ok else (f"{st.rows} rows ok" if st.present else "absent")
        lines.append(f"{name} {st.path}: {state}")
    lines += [f"  note: {n}" for n in idx.notes]
    if args.repair:
        lines.append(f"repaired {rep.repaired} index rows" + "".join(f"; {d}" for d in idx.repaired))
    if args.remove:
        lines.append(f"removed {rep.removed}")
    read_only = not writable(disk.root) or not writable(Path(args.store))
    if read_only:  # what it cannot do here; the checks above read everything
        lines.append("the store is read-only here: checked only (--repair and --remove need write access)")
    # the advice names the flag that does it: verify and --repair classify every file the same way
    if rep.unindexed or idx.bad or (problem and not args.repair):
        what = [f"index the {len(rep.unindexed)} unindexed cache files again"] if rep.unindexed else []
        what += ["rebuild the KV manifest"] if problem and not args.repair and not rep.unindexed else []
        what += [f"rebuild the {' and the '.join(n.split(':')[0] for n in idx.bad)}"] if idx.bad else []
        lines.append(f"run with --repair to {' and '.join(what)}")
    if (rep.bad or rep.stale or rep.orphans) and not args.remove:
        lines.append(
            f"run with --remove to delete the {len(rep.bad)} bad, {len(rep.stale)} stale and {len(rep.orphans)} "
            "orphan files (damaged caches are also recomputed when asked)"
        )
    obj = (
        rep.as_dict()
        | idx.as_dict()
        | {
            "node_links": len(links),
            "dangling_links": dangling,
            "manifest": {"problem": problem, "rebuilt": bool(problem and args.repair)},
            "read_only": read_only,
            "repaired": rep.repaired,  # cache files indexed again (the index rebuilds: indexes_repaired)
            "indexes_repaired": idx.repaired,
        }
    )
    drifted = False
    if getattr(args, "deep", False):
        drift = _deep(args, disk)
        obj["drift"] = drift.as_dict()
        lines.append(
            f"deep check ({drift.model_fingerprint}): recomputed {drift.checked} of {drift.entries} entries: "
            f"{drift.identical} identical, {len(drift.drifted)} drifted, {len(drift.unreadable)} unreadable"
            + (f"; {drift.other_models} of other models skipped" if drift.other_models else "")
        )
        lines += [f"  drifted {k}: max |stored - recomputed| = {d:.3g}" for k, d in drift.drifted]
        if drift.drifted and args.remove:
            gone = sum(disk.delete(ChunkKey.from_string(k)) for k, _ in drift.drifted)
            lines.append(f"removed {gone} drifted entries (computed again when next asked)")
        elif drift.drifted:
            lines.append("run with --remove to delete the drifted entries (computed again when next asked)")
        drifted = bool(drift.unreadable) or (bool(drift.drifted) and not args.remove)
    _emit(args, obj, lines)
    bad = (rep.bad and not args.remove) or rep.unindexed or idx.bad or (problem and not args.repair) or drifted
    return 1 if bad else 0


def _deep(args: argparse.Namespace, disk: DiskTier):
    """Recompute stored caches with the model (loaded here: the other commands never load it)."""
    from qcfuse_core.ingest.drift import check_drift
    from qcfuse_core.model.adapter import load_model

    adapter = load_model(args.model, dtype=args.dtype, device=args.device)

    def progress(done: int, total: int) -> None:
        if done == total or done % 10 == 0:
            sys.stderr.write(f"\rrecomputed {done}/{total}")
            if done == total:
                sys.stderr.write("\n")

    return check_drift(disk, adapter, sample=args.sample, progress=progress)


def _gc(args: argparse.Namespace, disk: DiskTier) -> int:
    rep = gc(disk, args.max_bytes, grace_s=args.grace_s)
    _emit(
        args,
        rep.as_dict(),
        [
            f"removed {rep.removed_entries} entries ({rep.removed_bytes:,} bytes) and "
            f"{rep.removed_orphans} orphan files; {rep.total_bytes:,} bytes left"
        ],
    )
    return 0


def _clear(args: argparse.Namespace, disk: DiskTier) -> int:
    if not args.yes:
        n, b = disk.manifest.count_and_bytes()
        sys.stderr.write(f"would remove {n} entries ({b:,} bytes) from {disk.root}; pass --yes to do it\n")
        return 2
    n = clear(disk)
    _emit(args, {"removed_entries": n}, [f"removed {n} entries from {disk.root}"])
    return 0


_COMMANDS = {"stats": _stats, "verify": _verify, "gc": _gc, "clear": _clear}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m qcfuse_core.cli.store store stats --store DIR`)."""
    parser = argparse.ArgumentParser(prog="qcfuse")
    add_store_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_store_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
