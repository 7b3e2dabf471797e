"""Kernel micro-benchmark: QCFuse Triton kernels against their baselines.

    python qcfuse_core/eval/kernels.py --json kernels.json      # CUDA (H200)
    python qcfuse_core/eval/kernels.py --cpu-smoke              # tiny shapes, interpreter, no GPU

Cases (defaults: T = 10K keys, H/Hkv = 32/8, D = 128, bf16):
  sparse_attention  R = 15% / 30% of T rows at random sorted positions (incl. T-1) vs
                    torch SDPA on the same rows and keys with the equivalent boolean mask
                    (K/V pre-expanded to H heads outside the timing). Both report achieved
                    TFLOP/s for the same useful FLOPs 4 * sum_i (q_pos_i + 1) * H * D.
                    Target: ours >= 60% of SDPA's. A dense causal flash SDPA over all T
                    rows is listed for context (what the GPU does for full prefill).
  attention_mass    32 probe rows at the end vs the ideal time max(bytes / peak BW,
                    FLOPs / peak) - bytes: K once + q + mass; FLOPs: the two Q.K passes.
  rerotate_scatter  R = 15% / 30% fresh rows vs a plain device copy of the same bytes
                    (read + write of K and V). Target: within 2x.

Timing: median over --iters after --warmup calls, CUDA events, L2 flushed before each
sample (a 256 MB memset) so memory-bound kernels are not served from L2. Prints a
markdown table; --json writes every number plus the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write results to this JSON file")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU via the Triton interpreter")
    p.add_argument("--tokens", type=int, default=10_000, help="keys T")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.30], help="rows recomputed")
    p.add_argument("--probe-rows", type=int, default=32)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth for ideal times (H200: 4.8)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 tensor TFLOP/s (H200: 989)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.tokens, args.heads, args.kv_heads, args.head_dim = 256, 4, 2, 32
        args.probe_rows, args.warmup, args.iters = 4, 1, 2
    return args


# max abs error allowed vs the fp32-internal reference (same as tests/test_kernels.py)
TOL = {"bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3), "float32": (2e-5, 1e-5), "mass": (1e-6, 1e-3)}


def check(out, expected, tol) -> dict:
    """Correctness next to each timing, so one GPU run gives both (no pytest needed)."""
    atol, rtol = tol
    out, expected = out.float(), expected.float()
    err = (out - expected).abs()
    ok = bool((err <= atol + rtol * expected.abs()).all()) and bool(out.isfinite().all())
    return dict(max_abs_err=err.max().item(), check_ok=ok)


class Timer:
    """Median milliseconds of fn() after warm-up; CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, torch, device, warmup, iters):
        self.torch, self.device, self.warmup, self.iters = torch, device, warmup, iters
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def bench_sparse_attention(torch, ops, ref, timer, args, device, dtype, frac, gen):
    import torch.nn.functional as F

    T, H, Hkv, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    R = max(2, round(frac * T))
    q = torch.randn(R, H, D, generator=gen).to(device, dtype)  # (R, H, D)
    k = torch.randn(T, Hkv, D, generator=gen).to(device, dtype)  # (T, Hkv, D)
    v = torch.randn(T, Hkv, D, generator=gen).to(device, dtype)
    pos = torch.randperm(T - 1, generator=gen)[: R - 1]
    q_pos = torch.sort(torch.cat([pos, torch.tensor([T - 1])])).values.to(device)  # (R,) incl. T-1
    scale = D**-0.5
    flops = 4.0 * float((q_pos + 1).sum()) * H * D

    # SDPA on the same work: (1, H, R, D) rows vs (1, H, T, D) keys, (1, 1, R, T) bool mask
    rep = H // Hkv
    q_s = q.transpose(0, 1).unsqueeze(0)
    k_s = k.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    v_s = v.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    mask = (torch.arange(T, device=device)[None, :] <= q_pos[:, None])[None, None]

    ours = ops.sparse_attention(q, k, v, q_pos, scale)
    theirs = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, scale=scale)[0].transpose(0, 1)
    max_err = (ours.float() - theirs.float()).abs().max().item()
    correct = check(ours, ref.sparse_attention_ref(q, k, v, q_pos, scale), TOL[args.dtype])

    t_ours = timer(lambda: ops.sparse_attention(q, k, v, q_pos, scale))

    def sdpa():
        return F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, scale=scale)

    t_sdpa = timer(sdpa)
    tf_ours, tf_sdpa = flops / t_ours / 1e9, flops / t_sdpa / 1e9
    res = dict(
        op="sparse_attention",
        case=f"T={T} R={R} ({frac:.0%}) H={H}/{Hkv} D={D} {args.dtype}",
        ms=t_ours,
        tflops=tf_ours,
        baseline="sdpa+bool mask",
        baseline_ms=t_sdpa,
        baseline_tflops=tf_sdpa,
        ratio=tf_ours / tf_sdpa,
        target=">= 0.60 of SDPA TFLOP/s",
        ok=tf_ours >= 0.6 * tf_sdpa,
        flops=flops,
        max_abs_err_vs_sdpa=max_err,
        config=_tuned_config(ops, H // Hkv, D, dtype),
        **correct,
    )
    return res


def bench_dense_causal(torch, timer, args, device, dtype, gen):
    """Context row: full causal prefill attention over all T rows (flash SDPA)."""
    import torch.nn.functional as F

    T, H, D = args.tokens, args.heads, args.head_dim
    q, k, v = (torch.randn(1, H, T, D, generator=gen).to(device, dtype) for _ in range(3))
    flops = 4.0 * (T * (T + 1) / 2) * H * D
    t = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return dict(
        op="sdpa_causal_dense",
        case=f"T={T} all rows H={H} D={D} {args.dtype}",
        ms=t,
        tflops=flops / t / 1e9,
        baseline="-",
        baseline_ms=None,
        baseline_tflops=None,
        ratio=None,
        target="context only",
        ok=None,
        flops=flops,
    )


def bench_attention_mass(torch, ops, ref, timer, args, device, dtype, gen):
    T, H, Hkv, D, R = args.tokens, args.heads, args.kv_heads, args.head_dim, args.probe_rows
    q = torch.randn(R, H, D, generator=gen).to(device, dtype)
    k = torch.randn(T, Hkv, D, generator=gen).to(device, dtype)
    q_pos = torch.arange(T - R, T, device=device)  # probe = question tokens at the end
    scale = D**-0.5
    esize = q.element_size()
    nbytes = T * Hkv * D * esize + R * H * D * esize + T * 4
    flops = 2 * (2.0 * R * H * T * D)  # Q.K in the lse pass and again in the mass pass
    correct = check(ops.attention_mass(q, k, q_pos, scale), ref.attention_mass_ref(q, k, q_pos, scale), TOL["mass"])
    t = timer(lambda: ops.attention_mass(q, k, q_pos, scale))
    t_ref = timer(lambda: ref.attention_mass_ref(q, k, q_pos, scale))
    ideal = max(nbytes / (args.peak_tbps * 1e9), flops / (args.peak_tflops * 1e9))  # ms
    return dict(
        op="attention_mass",
        case=f"T={T} probes={R} H={H}/{Hkv} D={D} {args.dtype}",
        ms=t,
        tflops=flops / t / 1e9,
        gbps=nbytes / t / 1e6,
        baseline="ideal max(bytes/BW, FLOPs/peak)",
        baseline_ms=ideal,
        baseline_tflops=None,
        ratio=t / ideal,
        target="report (x of ideal)",
        ok=None,
        torch_reference_ms=t_ref,
        bytes=nbytes,
        flops=flops,
        **correct,
    )


def bench_rerotate(torch, ops, ref, timer, args, device, dtype, frac, gen):
    T, Hkv, D = args.tokens, args.kv_heads, args.head_dim
    R = max(1, round(frac * T))
    k_pre = torch.randn(T, Hkv, D, generator=gen).to(device, dtype)
    v = torch.randn(T, Hkv, D, generator=gen).to(device, dtype)
    rows = torch.sort(torch.randperm(T, generator=gen)[:R]).values.to(device)
    k_new = torch.randn(R, Hkv, D, generator=gen).to(device, dtype)
    v_new = torch.randn(R, Hkv, D, generator=gen).to(device, dtype)
    ang = torch.arange(T, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, D, 2) / D))[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(device, dtype), ang.sin().to(device, dtype)
    kv_bytes = 2 * T * Hkv * D * k_pre.element_size()  # K and V, read once and written once
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    k_rot, v_out = ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin)
    k_exp, v_exp = ref.rerotate_scatter_ref(k_pre, v, rows, k_new, v_new, cos, sin)
    correct = check(k_rot, k_exp, TOL[args.dtype])
    correct["check_ok"] = correct["check_ok"] and torch.equal(v_out, v_exp)
    del k_rot, v_out, k_exp, v_exp
    t = timer(lambda: ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin))
    t_copy = timer(lambda: dst.copy_(src))
    t_ref = timer(lambda: ref.rerotate_scatter_ref(k_pre, v, rows, k_new, v_new, cos, sin))
    # as fused prefill calls it: the inverse row index built once per request, reused per layer
    inv = ops.inverse_rows(rows, T)
    k_rot, v_out = ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin, inv=inv)
    correct_inv = check(
        k_rot, k_exp_again := ref.rerotate_scatter_ref(k_pre, v, rows, k_new, v_new, cos, sin)[0], TOL[args.dtype]
    )
    del k_rot, v_out, k_exp_again
    t_inv = timer(lambda: ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin, inv=inv))
    moved = 2 * kv_bytes
    case = f"T={T} R={R} ({frac:.0%}) Hkv={Hkv} D={D} {args.dtype}"
    common = dict(
        baseline="copy of the same bytes",
        baseline_ms=t_copy,
        baseline_tflops=None,
        target="<= 2.0x copy time",
        torch_reference_ms=t_ref,
        bytes=moved,
    )
    return [
        dict(
            op="rerotate_scatter",
            case=case,
            ms=t,
            gbps=moved / t / 1e6,
            ratio=t / t_copy,
            ok=t <= 2.0 * t_copy,
            **common,
            **correct,
        ),
        dict(
            op="rerotate_scatter (inv reused)",
            case=case,
            ms=t_inv,
            gbps=moved / t_inv / 1e6,
            ratio=t_inv / t_copy,
            ok=t_inv <= 2.0 * t_copy,
            **common,
            **correct_inv,
        ),
    ]


def _tuned_config(ops, group, D, dtype):
    import torch

    try:
        tuner = ops._tuned_attention_kernel(
            group, ops._block_d(D), ops.backend() == "interpret", dtype == torch.float32
        )
    except ImportError:
        return None
    cfg = getattr(tuner, "best_config", None)
    return None if cfg is None else dict(**cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_cell(r) -> str:
    if "check_ok" not in r:
        return "-"
    return f"{'ok' if r['check_ok'] else 'MISMATCH'} ({r['max_abs_err']:.1e})"


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(results) -> str:
    lines = [
        "| op | case | ms | TFLOP/s | GB/s | baseline | baseline ms | baseline TFLOP/s | ratio | target | ok | vs reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ok = {True: "yes", False: "NO", None: "-"}[r.get("ok")]
        lines.append(
            f"| {r['op']} | {r['case']} | {r['ms']:.3f} | {_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('gbps'), '.0f')} "
            f"| {r['baseline']} | {_fmt(r.get('baseline_ms'), '.3f')} | {_fmt(r.get('baseline_tflops'), '.1f')} "
            f"| {_fmt(r.get('ratio'), '.2f')} | {r['target']} | {ok} | {_check_cell(r)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # entry point: before triton is imported

    import torch

    _ensure_importable()
    from qcfuse_kernels import ops
    from qcfuse_kernels import reference as ref

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU host, or pass --cpu-smoke", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    timer = Timer(torch, device, args.warmup, args.iters)
    print(f"backend: {ops.backend()}  device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")

    results = []
    for frac in args.fractions:
        results.append(bench_sparse_attention(torch, ops, ref, timer, args, device, dtype, frac, gen))
    results.append(bench_dense_causal(torch, timer, args, device, dtype, gen))
    results.append(bench_attention_mass(torch, ops, ref, timer, args, device, dtype, gen))
    for frac in args.fractions:
        results.extend(bench_rerotate(torch, ops, ref, timer, args, device, dtype, frac, gen))

    print(markdown(results))
    for r in results:
        if r.get("config") or r.get("max_abs_err_vs_sdpa") is not None:
            print(
                f"{r['op']} {r['case']}: config {r.get('config')}, max |ours - sdpa| {r.get('max_abs_err_vs_sdpa'):.2e}"
            )
    if args.json:
        env = dict(
            python=platform.python_version(),
            torch=torch.__version__,
            backend=ops.backend(),
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            triton=_triton_version(),
            cpu_smoke=args.cpu_smoke,
            warmup=args.warmup,
            iters=args.iters,
            peak_tbps=args.peak_tbps,
            peak_tflops=args.peak_tflops,
        )
        with open(args.json, "w") as f:
            json.dump(dict(env=env, results=results), f, indent=2)
        print(f"wrote {args.json}")
    failed = [r["case"] for r in results if r.get("check_ok") is False]
    if failed:
        print(f"MISMATCH vs reference: {failed}", file=sys.stderr)
        return 1
    return 0


def _ensure_importable() -> None:
    """Run from a bare checkout too: map ../kernels to `qcfuse_kernels` if not installed."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("qcfuse_kernels") is not None:
        return
    root = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.util.spec_from_file_location(
        "qcfuse_kernels", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None  # a .py file location always has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["qcfuse_kernels"] = module
    spec.loader.exec_module(module)


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
