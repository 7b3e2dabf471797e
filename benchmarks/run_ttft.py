"""Run `qcfuse bench ttft` (or the CUDA prefetch check) from a bare checkout: no install needed.

    python benchmarks/run_ttft.py check-cuda            # prefetcher == default source on CUDA, all tiers
    python benchmarks/run_ttft.py ttft --shape ...      # the `qcfuse bench ttft` flags

Maps ../kernels to `qcfuse_kernels` and the repository root onto sys.path when the package
is not installed (the H200 image has torch, triton, transformers, safetensors and xxhash).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ensure_importable() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("qcfuse_kernels") is not None:
        return
    kroot = ROOT / "kernels"
    spec = importlib.util.spec_from_file_location("qcfuse_kernels", kroot / "__init__.py",
                                                  submodule_search_locations=[str(kroot)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["qcfuse_kernels"] = module
    spec.loader.exec_module(module)


def check_cuda() -> int:
    """Prefetcher layers and fused logits equal the in-memory default on CUDA (gpu/host/disk
    tiers, threaded and not), and the fused loop does no host sync per layer."""
    import tempfile

    import torch

    from qcfuse_core.testing import cache_alone
    from qcfuse_core.fusion import FusedPrompt, Segment, fused_prefill
    from qcfuse_core.prefetch import PrefetchConfig, Prefetcher
    from qcfuse_core.selectors import SelectionContext, get_selector
    from qcfuse_core.store import open_store
    from qcfuse_core.testing import tiny_model

    import qcfuse_kernels as K

    print("kernel backend:", K.backend(), "| device:", torch.cuda.get_device_name())
    ad = tiny_model("llama", dtype=torch.bfloat16)
    ad.model.to("cuda")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (n,), generator=g) for n in (6, 40, 33, 21, 5)]
    pre, chunk_ids, suffix = ids[0], ids[1:4], ids[4]
    chunks = [cache_alone(ad, c) for c in chunk_ids]
    pchunk = cache_alone(ad, pre)
    ok = True
    for tier in ("gpu", "host", "disk"):
        for threaded in (True, False):
            with tempfile.TemporaryDirectory() as d:
                st = open_store(d, memory_bytes=(64 << 20) if tier != "disk" else 0,
                                gpu_bytes=(64 << 20) if tier == "gpu" else 0, use_cuda=True)
                for c in chunks:
                    st.put(c)
                    if tier == "gpu":
                        st.get(c.key)
                pf = Prefetcher(ad, st, PrefetchConfig(threaded=threaded))
                segs_ref = [Segment("prefix", pre, pchunk)] + [Segment("chunk", i, c) for i, c in zip(chunk_ids, chunks)]
                segs = [Segment("prefix", pre, pchunk)] + [Segment("chunk", i, pf.view(c.key, i)) for i, c in zip(chunk_ids, chunks)]
                segs_ref[2] = Segment("chunk", chunk_ids[1], None)  # one chunk recomputed
                segs[2] = Segment("chunk", chunk_ids[1], None)
                ref = FusedPrompt(segs_ref + [Segment("suffix", suffix)])
                lazy = FusedPrompt(segs + [Segment("suffix", suffix)])
                like = torch.empty((0, ad.shape.num_kv_heads, ad.shape.head_dim), device="cuda", dtype=ad.dtype)
                for rep in range(2):  # second request reuses the buffers
                    session = pf.start(lazy)
                    same = True
                    for l in range(ad.num_layers):
                        k, v = session.layer(l, like)
                        rk, rv = ref.layer(l, like)
                        same &= torch.equal(k, rk) and torch.equal(v, rv)
                    r = session.finish()
                    sources = dict(r.sources)
                sel = get_selector("epic").select(SelectionContext(ad, ref, 0.3))
                want = fused_prefill(ad, ref, sel.rows, logits_last=None).logits
                session = pf.start(lazy)
                got = fused_prefill(ad, lazy, sel.rows, logits_last=None, source=session).logits
                r = session.finish()
                same_logits = torch.equal(got, want)
                print(f"tier={tier:4s} threaded={threaded!s:5s} layers_equal={same} logits_equal={same_logits} "
                      f"sources={sources} wait_ms={[round(w, 3) for w in r.wait_ms]}")
                ok &= same and same_logits
                st.close()
    print("CHECK", "OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    ensure_importable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check-cuda"]:
        return check_cuda()
    from qcfuse_core.bench_ttft import add_ttft_parser

    parser = argparse.ArgumentParser(prog="run_ttft.py")
    add_ttft_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
