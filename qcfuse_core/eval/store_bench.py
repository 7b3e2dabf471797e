"""Chunk store read throughput: one layer of C chunks from each tier vs the machine's raw rates.

Default shape: 10 chunks x 1024 tokens of Llama-3.1-8B KV (32 layers, 8 KV heads x 128 dims,
bf16): one layer of one chunk is 4 MiB (K and V), so each measurement moves 40 MiB.

    tier read (what the engine's layer pipeline does)        raw reference
    disk, page cache dropped -> host buffer                  large file read, cache dropped;
                                                             and the same byte ranges read
                                                             with plain preadv (no checks)
    disk, page cache warm    -> host buffer                  large file read, warm
    host tier                -> host buffer                  memcpy
    host tier (pinned)       -> GPU        (CUDA only)       pinned host-to-device copy
    disk, cache dropped      -> GPU        (CUDA only)       large file read, cache dropped
    GPU tier                 -> GPU        (CUDA only)       device-to-device copy

Usage: python qcfuse_core/eval/store_bench.py [--json OUT] [--storage auto|fp8] [--dir DIR]
       python -m qcfuse_core.eval.store_bench --capacity [--json OUT]: the host tier's usable
       capacity with chunks of 150-1000 tokens, its arena against one power-of-two block per
       image (`capacity_churn`; CPU, a minute or two).
The store folder defaults to a temporary folder on the same disk as /tmp; use --dir to
measure another disk. Page cache is dropped per file with posix_fadvise(DONTNEED) (no root).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qcfuse_core.store import STORE_FORMAT_VERSION as FORMAT_VERSION  # noqa: E402
from qcfuse_core.store import open_store  # noqa: E402
from qcfuse_core.store.entry import EntryLayout  # noqa: E402
from qcfuse_core.types import ChunkKey, KVChunk  # noqa: E402

MiB = 1 << 20


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, repeats: int, *, before=None, cuda: bool = False) -> float:
    """Median seconds of `fn` over `repeats` runs (after one warm-up); `before` runs untimed."""
    times = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def raw_rates(folder: Path, file_mib: int, copy_bytes: int, repeats: int, cuda: bool) -> dict[str, float]:
    """GB/s of a large sequential file read (cold and warm), memcpy, and CUDA copies."""
    out = {}
    path = folder / "raw.bin"
    block = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8).numpy()
    with open(path, "wb") as f:
        for _ in range(max(1, file_mib // 64)):
            f.write(block)  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
        f.flush()
        os.fsync(f.fileno())
    size = path.stat().st_size
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    view = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+

    def read_file():
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < size:
                got += f.readinto(view[got : got + 64 * MiB])

    out["file_read_cold"] = size / timed(read_file, repeats, before=lambda: drop_cache(path)) / 1e9
    out["file_read_warm"] = size / timed(read_file, repeats) / 1e9
    path.unlink()
    n = copy_bytes
    src = torch.empty(n, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dst = torch.empty(n, dtype=torch.uint8)
    out["memcpy"] = n / timed(lambda: dst.copy_(src), repeats) / 1e9
    if cuda:
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        out["h2d_pinned"] = n / timed(lambda: dev.copy_(src, non_blocking=True), repeats, cuda=True) / 1e9
        out["h2d_pageable"] = n / timed(lambda: dev.copy_(dst), repeats, cuda=True) / 1e9
        dev2 = torch.empty_like(dev)
        out["d2d"] = n / timed(lambda: dev2.copy_(dev), repeats, cuda=True) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layer", type=int, default=None, help="layer to read (default: middle)")
    ap.add_argument("--storage", default="auto", help="storage dtype of the store (auto = bf16 here)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--raw-file-mib", type=int, default=1024)
    ap.add_argument(
        "--raw-copy-mib", type=int, default=None, help="size of the raw copies (default: the bytes of one layer batch)"
    )
    ap.add_argument("--dir", type=Path, default=None, help="folder for the store (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (1 avoids thread-pool stalls on a busy CPU)"
    )
    ap.add_argument(
        "--capacity",
        action="store_true",
        help="instead: the host tier's usable capacity with mixed chunk lengths (arena vs one "
        "power-of-two block per image), CPU only",
    )
    args = ap.parse_args(argv)
    if args.capacity:
        return capacity_main(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    cuda = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="bench_store_", dir=args.dir))
    C, T, L, Hkv, D = args.chunks, args.tokens, args.layers, args.kv_heads, args.head_dim
    layer = L // 2 if args.layer is None else args.layer
    try:
        # 1. write C chunks (random bf16 K/V) through a disk-only handle
        g = torch.Generator().manual_seed(0)
        keys = []
        t0 = time.perf_counter()
        with open_store(folder / "kv", memory_bytes=0, gpu_bytes=0, storage_dtype=args.storage) as s:
            for c in range(C):
                ids = torch.randint(0, 128_000, (T,), generator=g)
                kt = torch.randn(L, T, Hkv, D, generator=g, dtype=torch.float32).to(torch.bfloat16)  # (L, T, Hkv, D)
                chunk = KVChunk(ChunkKey.for_tokens("0" * 16, ids), ids, kt, kt.roll(1, dims=1))
                s.put(chunk)
                keys.append(chunk.key)
            entry_bytes = s.stats()["tiers"]["disk"]["bytes_used"]
            files = []
            for key in keys:
                entry = s.disk.manifest.lookup(key.to_string(), FORMAT_VERSION, args.storage)
                assert entry is not None  # every key was just written
                files.append(s.disk.root / entry.path)
        write_s = time.perf_counter() - t0
        stored_layer_bytes = None

        full = C * T * Hkv * D * 2 * 2  # bytes of one layer of C chunks, K + V, bf16 (decoded)
        rows: dict[str, float] = {}
        with open_store(folder / "kv", memory_bytes=0, gpu_bytes=0, storage_dtype=args.storage) as disk:

            def layout(key: ChunkKey) -> EntryLayout:
                lay = disk.disk.layout(key)
                assert lay is not None  # every key was just written
                return lay

            stored_layer_bytes = sum(layout(k).layer_bytes for k in keys)
            out_k = torch.empty((C * T, Hkv, D), dtype=torch.bfloat16, pin_memory=cuda)
            out_v = torch.empty_like(out_k)

            def read_disk_host():
                b = disk.read_layer_batch(keys, layer, out_k=out_k, out_v=out_v)
                assert all(b.found)

            def drop_all():
                for f in files:
                    drop_cache(f)

            spans = [layout(k).layer_spans[layer] for k in keys]
            scratch = memoryview(torch.empty(stored_layer_bytes, dtype=torch.uint8).numpy())  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+

            def read_ranges():  # the same bytes, plain preadv, one thread, no verification
                at = 0
                for f, (a, b) in zip(files, spans):
                    fd = os.open(f, os.O_RDONLY)
                    at += os.preadv(fd, [scratch[at : at + b - a]], a)
                    os.close(fd)

            range_cold = timed(read_ranges, args.repeats, before=drop_all)
            rows["disk (cold) -> host"] = timed(read_disk_host, args.repeats, before=drop_all)
            rows["disk (warm) -> host"] = timed(read_disk_host, args.repeats)
            if cuda:
                gk = torch.empty((C * T, Hkv, D), dtype=torch.bfloat16, device="cuda")
                gv = torch.empty_like(gk)

                def read_disk_gpu():  # verified reads into pinned buffers, then to the device
                    b = disk.read_layer_batch(keys, layer, out_k=gk, out_v=gv)
                    assert all(b.found)

                rows["disk (cold) -> GPU"] = timed(read_disk_gpu, args.repeats, before=drop_all, cuda=True)

        mem = 4 * entry_bytes  # capacity (pinned blocks are charged at their power-of-two size)
        with open_store(folder / "kv", memory_bytes=mem, gpu_bytes=0, storage_dtype=args.storage) as host:
            for k in keys:  # promote into the host tier
                host.get(k)
            assert all(k in host.host for k in keys)
            hk = torch.empty((C * T, Hkv, D), dtype=torch.bfloat16)
            hv = torch.empty_like(hk)
            rows["host tier -> host"] = timed(
                lambda: host.read_layer_batch(keys, layer, out_k=hk, out_v=hv), args.repeats
            )
            if cuda:
                gk = torch.empty((C * T, Hkv, D), dtype=torch.bfloat16, device="cuda")
                gv = torch.empty_like(gk)
                rows["host tier -> GPU"] = timed(
                    lambda: host.read_layer_batch(keys, layer, out_k=gk, out_v=gv), args.repeats, cuda=True
                )
        if cuda:
            with open_store(folder / "kv", memory_bytes=mem, gpu_bytes=mem, storage_dtype=args.storage) as gpu:
                for k in keys:
                    gpu.get(k)
                gpu_tier = gpu.gpu
                assert gpu_tier is not None  # CUDA and gpu_bytes > 0
                assert all(k in gpu_tier for k in keys)
                gk = torch.empty((C * T, Hkv, D), dtype=torch.bfloat16, device="cuda")
                gv = torch.empty_like(gk)
                rows["GPU tier -> GPU"] = timed(
                    lambda: gpu.read_layer_batch(keys, layer, out_k=gk, out_v=gv), args.repeats, cuda=True
                )

        # 2. raw rates of this machine
        copy_bytes = full if args.raw_copy_mib is None else args.raw_copy_mib * MiB
        raw = raw_rates(folder, args.raw_file_mib, copy_bytes, args.repeats, cuda)
        raw["same_ranges_cold"] = stored_layer_bytes / range_cold / 1e9
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    reference = {
        "disk (cold) -> host": ["file_read_cold", "same_ranges_cold"],
        "disk (warm) -> host": ["file_read_warm"],
        "host tier -> host": ["memcpy"],
        "host tier -> GPU": ["h2d_pinned"],
        "disk (cold) -> GPU": ["file_read_cold", "same_ranges_cold"],
        "GPU tier -> GPU": ["d2d"],
    }
    results = []
    for name, sec in rows.items():
        gbps = full / sec / 1e9  # decoded KV bytes delivered per second
        for ref in reference[name]:
            results.append(
                {
                    "path": name,
                    "ms": round(sec * 1e3, 3),
                    "GB/s": round(gbps, 2),
                    "stored_bytes": stored_layer_bytes,
                    "raw": ref,
                    "raw_GB/s": round(raw[ref], 2),
                    "of_raw": round(gbps / raw[ref], 3),
                }
            )
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_avg": os.getloadavg()[0],
            "gpu": torch.cuda.get_device_name() if cuda else None,
        },
        "shape": {
            "chunks": C,
            "tokens": T,
            "layers": L,
            "kv_heads": Hkv,
            "head_dim": D,
            "layer": layer,
            "storage": args.storage,
            "layer_bytes_decoded": full,
            "entry_bytes_total": entry_bytes,
            "write_s": round(write_s, 3),
        },
        "raw_GB/s": {k: round(v, 2) for k, v in raw.items()},
        "results": results,
    }
    print(f"one layer of {C} chunks x {T} tokens ({full / MiB:.0f} MiB decoded), storage {args.storage}")
    print(f"{'path':<22} {'ms':>9} {'GB/s':>8}   {'vs raw':<16} {'raw GB/s':>9} {'share':>6}")
    for r in results:
        print(
            f"{r['path']:<22} {r['ms']:>9.3f} {r['GB/s']:>8.2f}   {r['raw']:<16} {r['raw_GB/s']:>9.2f} "
            f"{r['of_raw']:>6.0%}"
        )
    print("raw:", ", ".join(f"{k} {v:.2f} GB/s" for k, v in report["raw_GB/s"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


LLAMA_8B_TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers x 8 KV heads x 128 dims, bf16
SCALE_LAYERS = 1  # the trace's entries: one layer, one KV head of 128 dims (520 B a token)


def capacity_churn(tier_bytes: int, *, puts: int, pool: int, seed: int, policy: str = "lru") -> dict[str, Any]:
    """Usable capacity of the host tier under churn: chunks of 150-1000 tokens, drawn from a
    pool, put (evicting) or hit; the tier `tier_bytes` of Llama-3.1-8B KV, simulated at 1/256
    scale (entries of one layer and one KV head: 520 B a token, slabs of 1 GiB / 256). At each
    put that had to evict: payload held / configured bytes, for the arena (`HostTier`) and for
    the same trace with each image charged its power-of-two block (per-image pinned
    allocations, before the arena)."""
    import random

    from qcfuse_core.store.arena import SLAB_BYTES
    from qcfuse_core.store.entry import EntryImage, plan_layout
    from qcfuse_core.store.eviction import get_policy
    from qcfuse_core.store.host_tier import HostTier
    from qcfuse_core.store.tier import charge_bytes

    scale = LLAMA_8B_TOKEN_BYTES // (2 * 128 * 2)  # 256
    rng = random.Random(seed)
    images = []
    for i in range(pool):
        layout, _ = plan_layout(
            ChunkKey("0" * 16, f"{i:064x}"), "auto", torch.bfloat16, 1, rng.randint(150, 1000), 1, 128
        )
        images.append(EntryImage(layout, torch.full((layout.file_bytes,), i % 251, dtype=torch.uint8)))
    index = {im.key: i for i, im in enumerate(images)}
    cap = tier_bytes // scale
    tier = HostTier("host", cap, get_policy(policy), slab_bytes=SLAB_BYTES // scale)
    old: dict[int, int] = {}  # the same trace, one power-of-two block per image, evicted in order
    held, arena, blocks = 0, [], []
    for _ in range(puts):
        i = rng.randrange(pool)
        im = images[i]
        if im.key in tier:
            tier.get(im.key)
        else:
            evicted = tier.put(im)
            if evicted:
                arena.append(held / cap)
            held += (im.nbytes if im.key in tier else 0) - sum(images[index[k]].nbytes for k in evicted)
        if i in old:
            old[i] = old.pop(i)  # lru: to the back
        else:
            need = charge_bytes(im.nbytes, "cpu", pinned=True)
            if sum(old.values()) + need > cap:
                blocks.append(sum(images[j].nbytes for j in old) / cap)
            while sum(old.values()) + need > cap:
                old.pop(next(iter(old)))
            old[i] = need
    summary = tier.summary()
    return {
        "tier_bytes": tier_bytes,
        "entries_held": summary["entries"],
        "evicting_puts": len(arena),
        "arena_mean": round(statistics.mean(arena), 4),
        "arena_min": round(min(arena), 4),
        "pow2_mean": round(statistics.mean(blocks), 4),
        "pow2_min": round(min(blocks), 4),
        "slabs": summary["arena_slabs"],
        "fragmentation_end": summary["fragmentation"],
    }


def capacity_main(args) -> int:
    GB = 10**9
    rows = [capacity_churn(n, puts=4000, pool=1500, seed=0) for n in (2 << 30, 8 << 30, 36 * GB)]
    print("host tier usable capacity, chunks of 150-1000 tokens (Llama-3.1-8B KV, simulated at 1/256)")
    print(f"{'tier':>8} {'held':>5} {'evicting':>8} {'arena mean':>10} {'min':>6} {'pow2 mean':>9} {'min':>6}")
    for r in rows:
        print(
            f"{r['tier_bytes'] / GB:>6.1f}GB {r['entries_held']:>5} {r['evicting_puts']:>8} {r['arena_mean']:>10.1%} "
            f"{r['arena_min']:>6.1%} {r['pow2_mean']:>9.1%} {r['pow2_min']:>6.1%}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpu": _cpu_name(), "cores": os.cpu_count()},
            "results": rows,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
