"""Per-tier occupancy and hit rates of a store, as `qcfuse store stats` and the studio show them.

    tier  entries  used / capacity         occupancy  hits  misses  hit rate  evictions
    gpu        12  1.50 GiB / 18.00 GiB        8.3%    40       2     95.2%          0
    host      200  25.00 GiB / 36.00 GiB      69.4%   310      52     85.6%         14
    disk      400  50.00 GiB / unbounded          -  2100       0    100.0%          0

The figures are `TieredStore.stats()["tiers"]` - counted in the process that holds the store
(memory tiers live only there), from its start. Disk hits and misses count layer reads as
well as whole-entry reads.
"""

from __future__ import annotations

TIER_ORDER = ("gpu", "host", "disk")  # fastest first
TIER_FIELDS = ("entries", "bytes_used", "capacity_bytes", "occupancy", "hits", "misses", "hit_rate", "evictions")


def tier_table(stats: dict) -> dict[str, dict]:
    """tier -> its TIER_FIELDS, fastest tier first, from a store's `stats()` (a store without
    tiers, the in-memory one: {}). occupancy and hit_rate are None for an unbounded tier and
    for one nothing was looked up in yet."""
    tiers = stats.get("tiers", {})
    names = [n for n in TIER_ORDER if n in tiers] + sorted(n for n in tiers if n not in TIER_ORDER)
    return {n: {f: tiers[n].get(f) for f in TIER_FIELDS} for n in names}


def _size(n: int | None) -> str:
    if n is None:
        return "unbounded"
    x, units = float(n), ["B", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while x >= 1024 and i < len(units) - 1:
        x /= 1024
        i += 1
    return f"{int(x)} B" if i == 0 else f"{x:.2f} {units[i]}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: int | None) -> str:
    return "-" if x is None else str(x)


def tier_lines(table: dict[str, dict]) -> list[str]:
    """The table as aligned text lines (a header, then one line per tier)."""
    head = ("tier", "entries", "used / capacity", "occupancy", "hits", "misses", "hit rate", "evictions")
    rows = [
        (
            name,
            _num(t["entries"]),
            f"{_size(t['bytes_used'])} / {_size(t['capacity_bytes'])}",
            _pct(t["occupancy"]),
            _num(t["hits"]),
            _num(t["misses"]),
            _pct(t["hit_rate"]),
            _num(t["evictions"]),
        )
        for name, t in table.items()
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(head).rstrip(), *(line(r).rstrip() for r in rows)]
