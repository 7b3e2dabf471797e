"""Decode-step benchmark: the scheduler's batched decode step (`model.runner.ModelRunner`) on
caches of a given length, for several batch sizes, and where one step's GPU time goes.

    python -m qcfuse_core.eval.decode --shape llama-3.1-8b --device cuda --dtype bf16 \\
        --context 10440 --streams 1 8 32 --json decode.json --markdown decode.md
    python -m qcfuse_core.eval.decode --shape tiny-llama --device cpu --context 64 --streams 1 2

What is timed is what the engine runs for every decoding request, after `--warmup` steps
that capture the graphs, in two modes (`--modes`):

    host   `ModelRunner.decode` (CUDA-graph replay on a GPU, eager `decode_batch` elsewhere)
           plus reading the greedy tokens back (`ModelRunner.argmax`) before the next step
    ahead  device-side sampling (`ModelRunner.launch`, engine/ahead.py): the graph's argmax
           feeds the next step on the device and the tokens are read back one step late

Each of B sequences has its own cache of `--context` visible tokens (random keys and values,
as a prefill would leave them), so a step reads the weights once and every sequence's K and
V; `--kv-dtype auto fp8` times the model's dtype and fp8 caches (`CacheConfig.kv_dtype`).
A row is the mean over `--steps` steps, timed by the host's clock around a synchronised
loop; `--deterministic both` adds the engine's deterministic mode (one bucket of rows).

The floor column is the time to read the bytes a step must read - the weights (embedding
table excepted) and the sequences' K and V up to their length (fp8: the codes and their
scales) - at `--peak-tbps`: the roofline. "of roofline" is floor / measured.

`--profile` (CUDA) records a step of each `--profile-streams` count with the torch profiler
and sums the GPU kernels' time by what they do (weight products, decode attention, its split
merge, norms, RoPE, cache writes, the MLP's activation, residual adds, other): the breakdown
that says where a step's time goes. Kernel names map to kinds by `KINDS`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone

import torch

# kernel-name fragments -> what the kernel does (first match wins; lower-case)
KINDS: tuple[tuple[str, str], ...] = (
    ("decode_combine", "attention merge"),
    ("decode_partial", "decode attention"),
    ("decode_fused", "decode attention"),
    ("kv_append", "cache write"),
    ("rope", "rope (+ cache write)"),
    ("rms_norm", "norm (+ residual add)"),
    ("silu", "mlp activation"),
    ("gemv", "weight products"),
    ("gemm", "weight products"),
    ("nvjet", "weight products"),
    ("cutlass", "weight products"),
    ("sm90", "weight products"),
    ("splitk", "weight products"),
    ("add", "residual add"),
    ("argmax", "sampling"),
    ("reduce", "sampling"),
    ("index", "embedding / gather"),
    ("copy", "copies"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for frag, kind in KINDS:
        if frag in low:
            return kind
    return "other"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", help="a named shape with random weights, or tiny-llama")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--context", type=int, default=10440, help="visible tokens in each sequence's cache")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="sequences per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each row (graph capture)")
    p.add_argument("--deterministic", choices=["off", "on", "both"], default="both")
    p.add_argument("--kv-dtype", nargs="+", choices=["auto", "fp8"], default=["auto"], help="the caches' KV dtypes")
    p.add_argument("--modes", nargs="+", choices=["host", "ahead"], default=["host", "ahead"], help="module docstring")
    p.add_argument("--no-graphs", action="store_true", help="eager decode_batch even on CUDA")
    p.add_argument("--profile", action="store_true", help="CUDA: where a step's time goes")
    p.add_argument("--profile-streams", type=int, nargs="+", default=[1], help="with --profile: these step sizes")
    p.add_argument(
        "--attention-tiles",
        nargs="*",
        default=[],
        metavar="BLOCK_N:WARPS:STAGES",
        help="CUDA: also time the smallest and largest step (host mode) with these launches of the attention's partial "
        "pass (`qcfuse_kernels.ops.DECODE_CONFIG`), for each KV dtype",
    )
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200 4.8, H100 3.35)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.context < 1 or a.steps < 1 or a.warmup < 0 or any(s < 1 for s in a.streams + a.profile_streams):
        p.error("--context, --steps and --streams must be positive, --warmup >= 0")
    if a.profile and max(a.profile_streams) > max(a.streams):
        p.error("--profile-streams must not exceed the largest of --streams")
    try:
        a.attention_tiles = [
            dict(zip(("BLOCK_N", "num_warps", "num_stages"), map(int, t.split(":")))) for t in a.attention_tiles
        ]
    except ValueError:
        p.error("--attention-tiles takes BLOCK_N:WARPS:STAGES, e.g. 64:4:3")
    if any(len(t) != 3 or min(t.values()) < 1 for t in a.attention_tiles):
        p.error("--attention-tiles takes BLOCK_N:WARPS:STAGES, e.g. 64:4:3")
    return a


def _model(args: argparse.Namespace):
    from qcfuse_core.model.testing import shaped_model, tiny_model

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.shape.startswith("tiny-"):
        adapter = tiny_model(args.shape[5:], dtype=dtype)
        adapter.model.to(args.device)
        return adapter
    return shaped_model(args.shape, dtype=dtype, device=args.device, seed=args.seed)


def _caches(adapter, n: int, context: int, seed: int, kv_dtype: str = "auto"):
    """n caches with `context` random tokens each and room for the timed steps."""
    from qcfuse_core.model.fusion import KVCache

    gen = torch.Generator(adapter.device).manual_seed(seed)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            c = KVCache(adapter, context + 64, kv_dtype)
            shape = (c.capacity, *c.k.shape[2:])
            for layer in range(adapter.num_layers):
                k, v = (torch.randn(shape, generator=gen, device=adapter.device) * 0.5 for _ in range(2))
                c.write(layer, slice(None), k, v)
            c.length = context
            out.append(c)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop(runner, caches, steps: int, ahead: bool) -> None:
    """`steps` decode steps: host mode reads each step's tokens before the next; ahead mode
    feeds them on the device and reads each step's after launching the next."""
    tokens = [1] * len(caches)
    if not ahead:
        for _ in range(steps):
            tokens = runner.argmax(list(runner.decode(caches, tokens)))
        return
    feed = list(range(len(caches)))
    launched = runner.launch(caches, tokens)
    for _ in range(steps - 1):
        nxt = runner.launch(caches, tokens, feed)
        launched.tokens()
        launched = nxt
    launched.tokens()


def time_steps(runner, caches, steps: int, warmup: int, ahead: bool = False) -> float:
    """Mean ms per decode step (with the greedy read-back) over `steps` after `warmup`."""
    dev = runner.adapter.device
    start_len = [c.length for c in caches]
    if warmup:
        _loop(runner, caches, warmup, ahead)
    _sync(dev)
    t0 = time.perf_counter()
    _loop(runner, caches, steps, ahead)
    _sync(dev)
    ms = (time.perf_counter() - t0) * 1000 / steps
    for c, n in zip(caches, start_len):
        c.length = n
    return ms


def floor_ms(adapter, streams: int, context: int, peak_tbps: float, kv_dtype: str = "auto") -> float:
    """Time to read the step's weights (embedding excepted) and every sequence's K and V (fp8:
    codes and scales): the roofline."""
    from qcfuse_core.model.fusion import KVCache

    emb = adapter.model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in adapter.model.parameters())
    if adapter.model.lm_head.weight.data_ptr() != emb.data_ptr():
        weights -= emb.numel() * emb.element_size()
    kv = KVCache.bytes_for(adapter, context, kv_dtype) * streams
    return (weights + kv) / (peak_tbps * 1e12) * 1e3


def profile_step(runner, caches, steps: int = 5) -> dict[str, float]:
    """GPU ms per step by kind of kernel (`KINDS`), one replayed step at a time."""
    from torch.profiler import ProfilerActivity, profile

    start_len = [c.length for c in caches]
    _loop(runner, caches, 2, False)
    _sync(runner.adapter.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _loop(runner, caches, steps, False)
        _sync(runner.adapter.device)
    for c, n in zip(caches, start_len):
        c.length = n
    by: dict[str, float] = {}
    kernels = 0
    for ev in prof.events():
        if getattr(ev, "device_type", None) is None or "CUDA" not in str(ev.device_type):
            continue
        us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        by[kind_of(ev.name)] = by.get(kind_of(ev.name), 0.0) + us / 1000 / steps
        kernels += 1
    by = dict(sorted(by.items(), key=lambda kv: -kv[1]))
    by["kernels per step"] = kernels / steps
    return by


def _rows_of_one_dtype(args: argparse.Namespace, adapter, kv_dtype: str, out: dict) -> list[dict]:
    """Every (deterministic, mode, streams) row on caches of `kv_dtype` (freed after), and
    with --profile the profiles of that dtype into out["profiles"]."""
    from qcfuse_core.model.runner import ModelRunner

    modes = {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]
    caches_all = _caches(adapter, max(args.streams), args.context, args.seed, kv_dtype)
    rows = []
    for det in modes:
        for mode in args.modes:
            runner = ModelRunner(adapter, cuda_graphs=not args.no_graphs, deterministic=det)
            for n in args.streams:
                ms = time_steps(runner, caches_all[:n], args.steps, args.warmup, ahead=mode == "ahead")
                fl = floor_ms(adapter, n, args.context, args.peak_tbps, kv_dtype)
                rows.append(
                    {
                        "streams": n,
                        "kv_dtype": kv_dtype,
                        "mode": mode,
                        "deterministic": det,
                        "graphs": runner.graphs,
                        "ms_per_step": round(ms, 3),
                        "floor_ms": round(fl, 6),
                        "roofline_fraction": round(fl / ms, 4),
                        "ms_per_token": round(ms / n, 3),
                    }
                )
                print(
                    f"kv {kv_dtype:4s} {mode:5s} streams {n:3d}  deterministic {str(det):5s}  {ms:8.3f} ms/step  "
                    f"floor {fl:.3f} ms  {100 * fl / ms:5.1f}% of roofline",
                    flush=True,
                )
    if args.attention_tiles and adapter.device.type == "cuda":
        out.setdefault("attention_tiles", []).extend(_tiles(args, adapter, caches_all, kv_dtype))
    if args.profile and adapter.device.type == "cuda":
        runner = ModelRunner(adapter, cuda_graphs=not args.no_graphs)
        for n in args.profile_streams:
            prof = profile_step(runner, caches_all[:n])
            out.setdefault("profiles", {})[f"{kv_dtype} {n}"] = prof
            print(f"profile: kv {kv_dtype}, {n} sequences", flush=True)
            for k, v in prof.items():
                print(f"  {k:24s} {v:8.3f}", flush=True)
    del caches_all
    if adapter.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _tiles(args: argparse.Namespace, adapter, caches, kv_dtype: str) -> list[dict]:
    """The smallest and the largest step (host mode) with each `--attention-tiles` launch of
    the attention's partial pass, the default restored after."""
    from qcfuse_core.model.runner import ModelRunner
    from qcfuse_kernels import ops

    default, rows = dict(ops.DECODE_CONFIG), []
    try:
        for tile in args.attention_tiles:
            ops.DECODE_CONFIG.clear()
            ops.DECODE_CONFIG.update(tile)
            for n in sorted({min(args.streams), max(args.streams)}):
                rows.append(_tile_row(args, adapter, caches[:n], kv_dtype, tile, ModelRunner(adapter)))
    finally:
        ops.DECODE_CONFIG.clear()
        ops.DECODE_CONFIG.update(default)
    return rows


def _tile_row(args: argparse.Namespace, adapter, caches, kv_dtype: str, tile: dict, runner) -> dict:
    """One tile's row: its step time and roofline fraction, or why it did not run from graphs
    (a tile the card cannot run - shared memory - fails its capture; reported, not fatal)."""
    n = len(caches)
    row: dict = {"kv_dtype": kv_dtype, "streams": n, **tile}
    try:
        ms = time_steps(runner, caches, args.steps, args.warmup)
    except Exception as e:
        row["error"] = str(e)[:200]
    else:
        if not runner.graphs:
            row["error"] = "its graphs could not be captured (the step ran eagerly)"
    if "error" in row:
        print(f"attention tile {tile}, {n} sequences: failed: {row['error']}", flush=True)
        return row
    fl = floor_ms(adapter, n, args.context, args.peak_tbps, kv_dtype)
    row.update(ms_per_step=round(ms, 3), roofline_fraction=round(fl / ms, 4))
    print(
        f"attention tile {tile}: kv {kv_dtype}, {n} sequences {ms:.3f} ms/step, {100 * fl / ms:.1f}% of roofline",
        flush=True,
    )
    return row


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    adapter = _model(args)
    dev = adapter.device
    out: dict = {"rows": []}
    for kv_dtype in args.kv_dtype:
        out["rows"] += _rows_of_one_dtype(args, adapter, kv_dtype, out)
        if args.json:  # what is measured so far, should a later dtype not finish
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if "profiles" in out and "auto 1" in out["profiles"]:
        out["profile_1_stream_ms"] = out["profiles"]["auto 1"]
    out["env"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "shape": args.shape,
        "dtype": args.dtype,
        "context": args.context,
        "peak_tbps": args.peak_tbps,
        "command": " ".join(sys.argv),
    }
    return out


def markdown(res: dict) -> str:
    lines = [
        "| sequences | KV | mode | deterministic | ms per step | floor ms | of roofline | ms per token |",
        "|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        det = "yes" if r["deterministic"] else "no"
        lines.append(
            f"| {r['streams']} | {r['kv_dtype']} | {r['mode']} | {det} | {r['ms_per_step']:.2f} | "
            f"{r['floor_ms']:.2f} | {100 * r['roofline_fraction']:.0f}% | {r['ms_per_token']:.2f} |"
        )
    if res.get("attention_tiles"):
        lines += [
            "",
            "| attention's partial pass (BLOCK_N, warps, stages) | KV | sequences | ms per step | of roofline |",
        ]
        lines += ["|---|---|---:|---:|---:|"]
        for t in res["attention_tiles"]:
            tile = f"| {t['BLOCK_N']}, {t['num_warps']}, {t['num_stages']} | {t['kv_dtype']} | {t['streams']} "
            if "error" in t:
                lines.append(tile + "| failed | - |")
            else:
                lines.append(tile + f"| {t['ms_per_step']:.2f} | {100 * t['roofline_fraction']:.0f}% |")
    for name, prof in res.get("profiles", {}).items():
        kv, n = name.split()
        lines += ["", f"| a step of {n} sequences ({kv} KV), GPU time by kind | ms |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" if k != "kernels per step" else f"| {k} | {v:.0f} |" for k, v in prof.items()]
    return "\n".join(lines) + "\n"


def write_outputs(args: argparse.Namespace, res: dict, md: str) -> None:
    """The table on stdout, the results to --json and the table to --markdown where given."""
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    write_outputs(args, res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
