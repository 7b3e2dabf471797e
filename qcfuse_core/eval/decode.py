"""Decode-step benchmark: the scheduler's batched decode step (`model.runner.ModelRunner`) on
caches of a given length, for several batch sizes, and where one step's GPU time goes.

    python -m qcfuse_core.eval.decode --shape llama-3.1-8b --device cuda --dtype bf16 \\
        --context 10440 --streams 1 8 32 --json decode.json --markdown decode.md
    python -m qcfuse_core.eval.decode --shape tiny-llama --device cpu --context 64 --streams 1 2

What is timed is what the engine runs for every decoding request: `ModelRunner.decode`
(CUDA-graph replay on a GPU, eager `decode_batch` elsewhere) plus reading the greedy tokens
back (`ModelRunner.argmax`), after `--warmup` steps that capture the graphs. Each of B
sequences has its own cache of `--context` visible tokens (random keys and values, as a
prefill would leave them), so a step reads the weights once and every sequence's K and V.
A row is the mean over `--steps` steps, timed by the host's clock around a synchronised
loop; `--deterministic both` adds the engine's deterministic mode (one bucket of rows).

The floor column is the time to read the bytes a step must read - the weights (embedding
table excepted) and the sequences' K and V up to their length - at `--peak-tbps`.

`--profile` (CUDA) records one sequence's step with the torch profiler and sums the GPU
kernels' time by what they do (weight products, decode attention, its split merge, norms,
RoPE, cache writes, the MLP's activation, residual adds, other): the breakdown that says
where a step's time goes. Kernel names map to kinds by `KINDS`.
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
    p.add_argument("--no-graphs", action="store_true", help="eager decode_batch even on CUDA")
    p.add_argument("--profile", action="store_true", help="CUDA: where one sequence's step goes")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200 4.8, H100 3.35)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.context < 1 or a.steps < 1 or a.warmup < 0 or any(s < 1 for s in a.streams):
        p.error("--context, --steps and --streams must be positive, --warmup >= 0")
    return a


def _model(args: argparse.Namespace):
    from qcfuse_core.model.testing import shaped_model, tiny_model

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.shape.startswith("tiny-"):
        adapter = tiny_model(args.shape[5:], dtype=dtype)
        adapter.model.to(args.device)
        return adapter
    return shaped_model(args.shape, dtype=dtype, device=args.device, seed=args.seed)


def _caches(adapter, n: int, context: int, gen: torch.Generator):
    """n caches with `context` random tokens each and room for the timed steps."""
    from qcfuse_core.model.fusion import KVCache

    out = []
    for _ in range(n):
        c = KVCache(adapter, context + 64)
        for t in (c.k, c.v):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.5)
        c.length = context
        out.append(c)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(runner, caches, steps: int, warmup: int) -> float:
    """Mean ms per decode step (with the greedy read-back) over `steps` after `warmup`."""
    dev = runner.adapter.device
    start_len = [c.length for c in caches]
    tokens = [1] * len(caches)
    for _ in range(warmup):
        tokens = runner.argmax(list(runner.decode(caches, tokens)))
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = runner.argmax(list(runner.decode(caches, tokens)))
    _sync(dev)
    ms = (time.perf_counter() - t0) * 1000 / steps
    for c, n in zip(caches, start_len):
        c.length = n
    return ms


def floor_ms(adapter, streams: int, context: int, peak_tbps: float) -> float:
    """Time to read the step's weights (embedding excepted) and every sequence's K and V."""
    emb = adapter.model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in adapter.model.parameters())
    if adapter.model.lm_head.weight.data_ptr() != emb.data_ptr():
        weights -= emb.numel() * emb.element_size()
    kv = adapter.shape.kv_bytes(context, emb.dtype) * streams
    return (weights + kv) / (peak_tbps * 1e12) * 1e3


def profile_step(runner, caches, steps: int = 5) -> dict[str, float]:
    """GPU ms per step by kind of kernel (`KINDS`), one replayed step at a time."""
    from torch.profiler import ProfilerActivity, profile

    tokens = [1] * len(caches)
    start_len = [c.length for c in caches]
    for _ in range(2):
        tokens = runner.argmax(list(runner.decode(caches, tokens)))
    _sync(runner.adapter.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tokens = runner.argmax(list(runner.decode(caches, tokens)))
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


def run(args: argparse.Namespace) -> dict:
    from qcfuse_core.model.runner import ModelRunner

    torch.manual_seed(args.seed)
    adapter = _model(args)
    dev = adapter.device
    gen = torch.Generator().manual_seed(args.seed)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]
    rows = []
    caches_all = _caches(adapter, max(args.streams), args.context, gen)
    for det in modes:
        runner = ModelRunner(adapter, cuda_graphs=not args.no_graphs, deterministic=det)
        for n in args.streams:
            ms = time_steps(runner, caches_all[:n], args.steps, args.warmup)
            fl = floor_ms(adapter, n, args.context, args.peak_tbps)
            rows.append(
                {
                    "streams": n,
                    "deterministic": det,
                    "graphs": runner._graphs is not None,
                    "ms_per_step": round(ms, 3),
                    "floor_ms": round(fl, 6),
                    "ms_per_token": round(ms / n, 3),
                }
            )
            print(
                f"streams {n:3d}  deterministic {str(det):5s}  {ms:8.3f} ms/step  floor {fl:.3f} ms",
                flush=True,
            )
    out: dict = {"rows": rows}
    if args.profile and dev.type == "cuda":
        runner = ModelRunner(adapter, cuda_graphs=not args.no_graphs)
        out["profile_1_stream_ms"] = prof = profile_step(runner, caches_all[:1])
        for k, v in prof.items():
            print(f"  {k:24s} {v:8.3f}", flush=True)
    out["env"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "shape": args.shape,
        "dtype": args.dtype,
        "context": args.context,
        "command": " ".join(sys.argv),
    }
    return out


def markdown(res: dict) -> str:
    lines = [
        "| sequences | deterministic | ms per step | floor ms | ms per token |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in res["rows"]:
        det = "yes" if r["deterministic"] else "no"
        lines.append(
            f"| {r['streams']} | {det} | {r['ms_per_step']:.2f} | {r['floor_ms']:.2f} | {r['ms_per_token']:.2f} |"
        )
    prof = res.get("profile_1_stream_ms")
    if prof:
        lines += ["", "| one sequence's step, GPU time by kind | ms |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" if k != "kernels per step" else f"| {k} | {v:.0f} |" for k, v in prof.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    md = markdown(res)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
