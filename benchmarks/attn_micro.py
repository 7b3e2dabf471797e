"""Fused prefill's attention on a GPU: our Triton sparse kernel against torch's own kernels.

    python3 benchmarks/attn_micro.py [--rows 1568] [--tokens 10240] [--json OUT]

Shape of `bench ttft`'s qcfuse@0.15 request on llama-3.1-8b (32 heads, 8 KV heads, head dim
128, bf16): R recomputed rows spread over T positions, each row attending to keys at
positions <= its own. Reported per call (median of 50 after warm-up):
  sparse      qcfuse_kernels.sparse_attention (what fused prefill runs)
  masked      the torch path: SDPA with a boolean row mask in 256-row blocks
  flex        torch FlexAttention with a block mask built from the rows (compiled)
  dense_flash SDPA flash over all T keys, no mask: twice the useful work - a speed reference
and the useful TFLOP/s of each (keys <= row only). Checks every output against `masked`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_ttft  # noqa: E402

run_ttft.ensure_importable()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qcfuse_kernels as K  # noqa: E402
from qcfuse_core.fusion import _masked_sdpa, ROW_BLOCK  # noqa: E402


def timeit(fn, runs=50, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1568)
    ap.add_argument("--tokens", type=int, default=10240)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    T, R, H, Hkv, D = a.tokens, a.rows, 32, 8, 128
    rows = torch.sort(torch.randperm(T - 1, device=dev)[: R - 1]).values
    rows = torch.cat([rows, torch.tensor([T - 1], device=dev)])
    q = torch.randn(R, H, D, device=dev, dtype=dt)
    k = torch.randn(T, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(T, Hkv, D, device=dev, dtype=dt)
    scale = D ** -0.5
    useful = 4.0 * H * D * float((rows + 1).sum())  # QK^T and PV over the visible keys
    res: dict = {"rows": R, "tokens": T, "heads": H, "kv_heads": Hkv, "head_dim": D, "device": torch.cuda.get_device_name()}

    ref = torch.cat([_masked_sdpa(q[s:s + ROW_BLOCK], k, v, rows[s:s + ROW_BLOCK], scale) for s in range(0, R, ROW_BLOCK)])
    cands = {
        "sparse": lambda: K.sparse_attention(q, k, v, rows, scale),
        "masked": lambda: torch.cat([_masked_sdpa(q[s:s + ROW_BLOCK], k, v, rows[s:s + ROW_BLOCK], scale)
                                     for s in range(0, R, ROW_BLOCK)]),
    }
    kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    cands["dense_flash"] = lambda: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], scale=scale)[0].transpose(0, 1)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

        def mask_mod(b, h, qi, kj):
            return kj <= rows[qi]

        bm = create_block_mask(mask_mod, None, None, R, T, device=dev)
        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        cands["flex"] = lambda: flex(qt, kt, vt, block_mask=bm, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        res["flex_block_mask_ms"] = timeit(lambda: create_block_mask(mask_mod, None, None, R, T, device=dev), runs=10, warm=2)
    except Exception as e:  # noqa: BLE001 - report, keep measuring the others
        res["flex_error"] = repr(e)[:300]
    for name, fn in cands.items():
        try:
            out = fn()
            err = (out.float() - ref.float()).abs().max().item() if name != "dense_flash" else None
            ms = timeit(fn)
            res[name] = {"ms": round(ms, 4), "useful_tflops": round(useful / ms / 1e9, 1), "max_abs_err_vs_masked": err}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": repr(e)[:300]}
        print(name, res[name], flush=True)
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
