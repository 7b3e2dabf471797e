"""`qcfuse store stats|verify|gc|clear` and the maintenance functions behind them."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
from store_fixtures import entry_bytes, entry_file, make_chunk, store_at

from qcfuse_core.cli.store import add_store_commands, parse_bytes
from qcfuse_core.store import kv_dir
from tests.qc_fixtures import _fill, _run


def test_stats(tmp_path, capsys):
    chunks = _fill(tmp_path)
    code, out, _ = _run(capsys, "stats", "--store", str(tmp_path), "--json")
    obj = json.loads(out)
    assert code == 0 and obj["entries"] == 4 and obj["nodes"] == 4
    assert obj["bytes"] == sum(entry_bytes(c) for c in chunks)
    assert obj["by_storage"] == [{"format_version": 1, "storage": "auto", "entries": 4,
                                  "bytes": obj["bytes"], "usable": True}]
    code, out, _ = _run(capsys, "stats", "--store", str(tmp_path))
    assert "entries 4" in out


def test_missing_store(tmp_path, capsys):
    code, _, err = _run(capsys, "stats", "--store", str(tmp_path / "nope"))
    assert code == 1 and "no KV store" in err
    assert not (tmp_path / "nope").exists()


def test_verify_reports_then_removes(tmp_path, capsys):
    chunks = _fill(tmp_path)
    root = kv_dir(tmp_path)
    with store_at(root) as s:
        bad = entry_file(s, chunks[1].key)
    with open(bad, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    orphan = root / "data" / ".tmp-1-dead-x.safetensors"
    orphan.write_bytes(b"partial")
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    code, out, _ = _run(capsys, "verify", "--store", str(tmp_path), "--json")
    rep = json.loads(out)
    assert code == 1 and rep["ok"] == 3 and len(rep["bad"]) == 1 and rep["bad"][0][0] == chunks[1].key.to_string()
    assert "checksum" in rep["bad"][0][1] and rep["orphans"] == ["data/.tmp-1-dead-x.safetensors"]
    code, out, _ = _run(capsys, "verify", "--store", str(tmp_path), "--remove")
    assert code == 0 and "removed 2" in out
    code, out, _ = _run(capsys, "verify", "--store", str(tmp_path))
    assert code == 0 and "3 ok, 0 bad" in out and not bad.exists() and not orphan.exists()


def test_verify_leaves_young_orphans(tmp_path, capsys):
    _fill(tmp_path, n=1)
    young = kv_dir(tmp_path) / "data" / ".tmp-2-live-y.safetensors"
    young.write_bytes(b"being written")
    code, out, _ = _run(capsys, "verify", "--store", str(tmp_path), "--remove")
    assert young.exists()


def test_gc_keeps_most_recently_used(tmp_path, capsys):
    chunks = _fill(tmp_path)
    root = kv_dir(tmp_path)
    with store_at(root) as s:  # make chunk 0 the most recently used
        s.disk.manifest.touch(chunks[0].key.to_string(), 1, "auto", time.time() + 100)
    n = entry_bytes(chunks[0])
    code, out, _ = _run(capsys, "gc", "--store", str(tmp_path), "--max-bytes", str(2 * n), "--json")
    rep = json.loads(out)
    assert code == 0 and rep["removed_entries"] == 2 and rep["total_bytes"] == 2 * n
    with store_at(root) as s:
        assert s.contains(chunks[0].key) and s.contains(chunks[3].key)
        assert not s.contains(chunks[1].key) and not s.contains(chunks[2].key)
    code, out, _ = _run(capsys, "gc", "--store", str(tmp_path), "--max-bytes", "0")
    assert "removed 2 entries" in out


def test_clear_needs_yes(tmp_path, capsys):
    _fill(tmp_path)
    code, _, err = _run(capsys, "clear", "--store", str(tmp_path))
    assert code == 2 and "pass --yes" in err
    code, out, _ = _run(capsys, "clear", "--store", str(tmp_path), "--yes")
    assert code == 0 and "removed 4 entries" in out
    with store_at(kv_dir(tmp_path)) as s:
        assert list(s.keys()) == [] and s.resolve("node-0") is None
    assert not list((kv_dir(tmp_path) / "data").rglob("*.safetensors"))


def test_hook_into_a_main_parser(tmp_path):
    parser = argparse.ArgumentParser(prog="qcfuse")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ask")
    add_store_commands(sub, default_store=tmp_path)
    args = parser.parse_args(["store", "gc", "--max-bytes", "10G"])
    assert args.store == tmp_path and args.max_bytes == 10 << 30 and args.func.__name__ == "run_store_command"
    assert args.func(args) == 1  # nothing ingested there yet


@pytest.mark.parametrize("text,value", [("123", 123), ("4K", 4096), ("1.5M", 3 << 19), ("2GiB", 2 << 30), ("1t", 1 << 40)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "ten", "-5", "5X"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="byte size"):
        parse_bytes(text)


def test_tier_stats_hit_rate_and_occupancy(tmp_path, capsys):
    """TieredStore.stats(): per tier its hit rate (hits / lookups; None before any) and
    occupancy (bytes used / capacity; the disk tier is bounded by default, sized from the disk:
    sizing.disk_tier_bytes); `store stats` shows
    the folder's disk tier in the same table (lookups are the serving process's: --url)."""
    from qcfuse_core.store.tier_report import TIER_FIELDS, tier_lines, tier_table

    chunks = [make_chunk(i) for i in range(3)]
    with store_at(kv_dir(tmp_path), memory_bytes=1 << 20) as s:
        assert s.stats()["tiers"]["host"]["hit_rate"] is None  # nothing looked up yet
        for c in chunks:
            s.put(c)
        assert s.get(chunks[0].key) is not None and s.get(chunks[1].key) is not None
        assert s.get(make_chunk(99).key) is None  # a miss in every tier
        stats = s.stats()
    host, disk = stats["tiers"]["host"], stats["tiers"]["disk"]
    assert host["hit_rate"] == host["hits"] / (host["hits"] + host["misses"])
    assert host["hits"] >= 2 and host["misses"] >= 1 and 0 < host["hit_rate"] < 1
    assert host["occupancy"] == host["bytes_used"] / (1 << 20) and 0 < host["occupancy"] < 1
    assert disk["capacity_bytes"] >= disk["bytes_used"] > 0 and disk["entries"] == 3
    assert disk["occupancy"] == disk["bytes_used"] / disk["capacity_bytes"]
    table = tier_table(stats)
    assert list(table) == ["host", "disk"] and all(set(t) == set(TIER_FIELDS) for t in table.values())
    lines = tier_lines(table)
    assert lines[0].split() == ["tier", "entries", "used", "/", "capacity", "occupancy", "hits", "misses", "hit",
                                "rate", "evictions"]
    assert lines[1].startswith("host") and f"{100 * host['hit_rate']:.1f}%" in lines[1]
    assert "/ 1.00 MiB" in lines[1] and "/ unbounded" not in lines[2]
    assert tier_table({"backend": "memory", "entries": 0}) == {}

    code, out, _ = _run(capsys, "stats", "--store", str(tmp_path), "--json")
    obj = json.loads(out)
    assert code == 0 and set(obj["tiers"]) == {"disk"} and set(obj["tiers"]["disk"]) == set(TIER_FIELDS)
    assert obj["tiers"]["disk"]["entries"] == 3 and obj["tiers"]["disk"]["bytes_used"] == obj["bytes"]
    assert obj["tiers"]["disk"]["hits"] is None  # counted by the process that serves, not here
    code, out, _ = _run(capsys, "stats", "--store", str(tmp_path))
    assert "tier  entries" in out and "--url URL" in out


def test_stats_url_that_does_not_answer(capsys):
    code, _, err = _run(capsys, "stats", "--store", "unused", "--url", "http://127.0.0.1:9")  # nothing listens
    assert code == 2 and "http://127.0.0.1:9/api/store" in err
