"""`qcfuse store ...`: inspect and maintain the KV store of a QCFuse store root.

    qcfuse store stats  --store DIR [--json]
    qcfuse store verify --store DIR [--remove] [--repair] [--json]
    qcfuse store gc     --store DIR --max-bytes N   (N may end in K, M, G or T: powers of 1024)
    qcfuse store clear  --store DIR [--yes]

DIR is the store root (it also holds the Chroma collection); the KV store is DIR/kv.
Hook: `add_store_commands(subparsers)` on the main parser's subparsers, then dispatch
`args.command == "store"` (or `args.func`) to `run_store_command(args)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from qcfuse_core.store.disk import MANIFEST_NAME, DiskTier
from qcfuse_core.store.entry import FORMAT_VERSION
from qcfuse_core.store.maintenance import DEFAULT_GRACE_S, clear, gc, verify
from qcfuse_core.store.tiered import kv_dir, writable

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
        p.add_argument("--store", required=default_store is None, default=default_store, type=Path,
                       metavar="DIR", help="store root (the KV store lives in DIR/kv)")
        p.add_argument("--json", action="store_true", help="print a JSON object")
        p.set_defaults(func=run_store_command)
        return p

    common(sub.add_parser("stats", help="entries, bytes and node links on disk", formatter_class=fmt))
    v = common(sub.add_parser("verify", formatter_class=fmt,
                              help="check every KV entry, sidecar and node link, the chunk-text index and "
                                   "the vector index"))
    v.add_argument("--remove", action="store_true",
                   help="delete bad, stale and orphaned files (never a file that verifies)")
    v.add_argument("--repair", action="store_true",
                   help="index intact entries again (after a lost manifest) and rebuild a damaged "
                        "chunk-text or vector index from the other")
    v.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                   help="leave orphan files younger than this many seconds alone (live writers)")
    g = common(sub.add_parser("gc", help="shrink the store to a byte budget (least recently used first)",
                              formatter_class=fmt))
    g.add_argument("--max-bytes", required=True, type=parse_bytes, metavar="N",
                   help="byte budget for the entries (K, M, G, T suffixes: powers of 1024)")
    g.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                   help="leave orphan files younger than this many seconds alone (live writers)")
    c = common(sub.add_parser("clear", help="remove every entry", formatter_class=fmt))
    c.add_argument("--yes", action="store_true", help="do it (without this, nothing is removed)")
    store.set_defaults(func=run_store_command)
    return store


def _emit(args: argparse.Namespace, obj: dict, lines: list[str]) -> None:
    out = json.dumps(obj, indent=2) if args.json else "\n".join(lines)
    sys.stdout.write(out + "\n")


def run_store_command(args: argparse.Namespace) -> int:
    """Run one `store` subcommand; returns the process exit code."""
    root = kv_dir(args.store)
    if not (root / MANIFEST_NAME).exists():
        sys.stderr.write(f"no KV store at {root} (nothing has been ingested there)\n")
        return 1
    changes = args.store_command in ("gc", "clear") or (
        args.store_command == "verify" and (args.remove or args.repair))
    if changes and not writable(root):
        sys.stderr.write(f"qcfuse: error: the KV store at {root} is read-only; `store "
                         f"{args.store_command}` needs to write there\n")
        return 2
    disk = DiskTier(root, read_only=not changes)
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
    obj = {
        "path": str(disk.root), "format_version": FORMAT_VERSION,
        "entries": sum(n for n, _ in groups.values()), "bytes": total,
        "sidecars": len(sidecars), "sidecar_bytes": sum(s.nbytes for s in sidecars),
        "nodes": disk.manifest.num_nodes(),
        "by_storage": [{"format_version": v, "storage": s, "entries": n, "bytes": b,
                        "usable": v == FORMAT_VERSION} for (v, s), (n, b) in sorted(groups.items())],
    }
    lines = [f"KV store {disk.root}  (format v{FORMAT_VERSION})",
             f"  entries {obj['entries']}  bytes {total:,}  sidecars {len(sidecars)}  nodes {obj['nodes']}"]
    for g in obj["by_storage"]:
        flag = "" if g["usable"] else "  (stale: another format version; `store gc` removes it)"
        lines.append(f"  v{g['format_version']} {g['storage']:>5}: {g['entries']} entries, {g['bytes']:,} bytes{flag}")
    lines += ["",
              "  entries   chunk caches (one per distinct chunk text and model); bytes: their files",
              "  sidecars  small per-chunk files the query probe reads first (anchors, critical-layer keys)",
              "  nodes     links from a framework's node id to its chunk cache (one per node and model)",
              "  v<N> <storage>: entries by format version and stored dtype (auto: the model's dtype)"]
    _emit(args, obj, lines)
    return 0


def _verify(args: argparse.Namespace, disk: DiskTier) -> int:
    from qcfuse_core.store import indexes

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
    lines = [f"checked {rep.checked} entries: {rep.ok} ok, {len(rep.bad)} bad, "
             f"{len(rep.stale)} stale, {len(rep.unindexed)} unindexed, {len(rep.orphans)} orphan files"]
    lines += [f"  bad {k}: {why}" for k, why in rep.bad]
    lines.append(f"node links: {len(links)} ({dangling} to a cache that is gone: computed again when asked)")
    for name, st in (("chunk-text index", idx.chunk_texts), ("vector index", idx.chroma)):
        state = "absent" if not st.present else (f"{st.rows} rows ok" if st.ok else f"BAD: {st.problem}")
        lines.append(f"{name} {st.path}: {state}")
    lines += [f"  note: {n}" for n in idx.notes]
    if args.repair:
        lines.append(f"repaired {rep.repaired} index rows" + "".join(f"; {d}" for d in idx.repaired))
    if args.remove:
        lines.append(f"removed {rep.removed}")
    if rep.unindexed or idx.bad:
        lines.append("run with --repair to index the intact entries again and rebuild a damaged index")
    elif (rep.bad or rep.stale or rep.orphans) and not args.remove:
        lines.append("run with --remove to delete them (damaged caches are also recomputed when asked)")
    obj = rep.as_dict() | idx.as_dict() | {"node_links": len(links), "dangling_links": dangling}
    _emit(args, obj, lines)
    bad = (rep.bad and not args.remove) or rep.unindexed or idx.bad
    return 1 if bad else 0


def _gc(args: argparse.Namespace, disk: DiskTier) -> int:
    rep = gc(disk, args.max_bytes, grace_s=args.grace_s)
    _emit(args, rep.as_dict(), [
        f"removed {rep.removed_entries} entries ({rep.removed_bytes:,} bytes) and "
        f"{rep.removed_orphans} orphan files; {rep.total_bytes:,} bytes left"])
    return 0


def _clear(args: argparse.Namespace, disk: DiskTier) -> int:
    if not args.yes:
        n, b = disk.manifest.count_and_bytes()
        sys.stderr.write(f"would remove {n} entries ({b:,} bytes) from {disk.root}; "
                         "pass --yes to do it\n")
        return 2
    n = clear(disk)
    _emit(args, {"removed_entries": n}, [f"removed {n} entries from {disk.root}"])
    return 0


_COMMANDS = {"stats": _stats, "verify": _verify, "gc": _gc, "clear": _clear}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m qcfuse_core.store.cli store stats --store DIR`)."""
    parser = argparse.ArgumentParser(prog="qcfuse")
    add_store_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_store_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
