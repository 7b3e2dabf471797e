"""The store's CUDA paths: pinned host tier, GPU tier, promotion, layer batches into device
buffers (fp8 decoded on the device). Skips without CUDA; CPU twins live in the other
test_store_* files."""

from __future__ import annotations

import pytest
import torch
from store_fixtures import make_chunk

from qcfuse_core.store import open_store

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _store(path, **kw):
    kw.setdefault("memory_bytes", 256 << 20)
    kw.setdefault("gpu_bytes", 256 << 20)
    return open_store(path, use_cuda=True, **kw)


@pytest.mark.parametrize("storage", ["auto", "fp8"])
def test_promotion_and_round_trip_on_cuda(tmp_path, storage):
    chunk = make_chunk(1, T=40, L=4)
    with _store(tmp_path, storage_dtype=storage) as s:
        s.put(chunk)
        assert s.host.get(chunk.key, count=False).data.is_pinned()
    with _store(tmp_path, storage_dtype=storage) as s:
        got = s.get(chunk.key)  # disk -> pinned host -> GPU
        assert got.k.is_cuda and chunk.key in s.gpu and chunk.key in s.host
        ref = make_chunk(1, T=40, L=4)
        if storage == "auto":
            assert torch.equal(got.k.cpu(), ref.k) and torch.equal(got.v.cpu(), ref.v)
        else:
            err = (got.k.float().cpu() - ref.k.float()).abs().max().item()
            assert err < 0.25, f"fp8 error {err}"
        st = s.stats()
        assert st["tiers"]["disk"]["hits"] == 1 and st["tiers"]["gpu"]["entries"] == 1


@pytest.mark.parametrize("storage", ["auto", "fp8"])
@pytest.mark.parametrize("where", ["disk", "host", "gpu"])
def test_layer_batch_into_device_buffers(tmp_path, storage, where):
    chunks = [make_chunk(10 + i, T=16 + i, L=3) for i in range(3)]
    with _store(tmp_path, storage_dtype=storage) as s:
        for c in chunks:
            s.put(c)
    mem = 0 if where == "disk" else 256 << 20
    with _store(tmp_path, storage_dtype=storage, memory_bytes=mem,
                gpu_bytes=(256 << 20) if where == "gpu" else 0) as s:
        if where != "disk":
            for c in chunks:
                s.get(c.key)  # promote
        keys = [c.key for c in chunks]
        T = sum(c.num_tokens for c in chunks)
        out_k = torch.empty((T, 2, 8), dtype=torch.bfloat16, device="cuda")
        out_v = torch.empty_like(out_k)
        batch = s.read_layer_batch(keys, 2, out_k=out_k, out_v=out_v)
        torch.cuda.synchronize()
        assert batch.found == [True] * 3
        cpu = open_store(tmp_path, memory_bytes=0, gpu_bytes=0, storage_dtype=storage, use_cuda=False)
        ref = cpu.read_layer_batch(keys, 2)  # the host decode of the same bytes
        cpu.close()
        assert torch.equal(out_k.cpu(), ref.k) and torch.equal(out_v.cpu(), ref.v)
