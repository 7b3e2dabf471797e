"""Entry format: bit-exact round trips per dtype, the fp8 error bound, single-layer reads,
safetensors interoperability, and the header checks."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from store_fixtures import make_chunk, store_at

from qcfuse_core.store.codec import dequantize_fp8, quantize_fp8, stored_dtype
from qcfuse_core.store.entry import EntryFormatError, encode_chunk, parse_header

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("storage", ["auto", "same"])
def test_round_trip_bit_exact(tmp_path, name, storage):
    dtype = DTYPES[name]
    storage = name if storage == "same" else storage
    chunk = make_chunk(1, dtype=dtype)
    with store_at(tmp_path, storage_dtype=storage) as s:
        s.put(chunk)
    with store_at(tmp_path, storage_dtype=storage) as s:  # cold: read from disk
        got = s.get(chunk.key)
        assert got is not None and got.k.dtype == dtype
        assert torch.equal(_bits(got.k), _bits(chunk.k)) and torch.equal(_bits(got.v), _bits(chunk.v))
        assert torch.equal(got.token_ids, chunk.token_ids)
        again = s.get(chunk.key)  # warm: from the host tier
        assert torch.equal(_bits(again.k), _bits(chunk.k))


def test_downcast_storage_returns_source_dtype(tmp_path):
    chunk = make_chunk(2, dtype=torch.float32)
    with store_at(tmp_path, storage_dtype="bf16") as s:
        s.put(chunk)
        got = s.get(chunk.key)
    assert got.k.dtype == torch.float32
    assert torch.equal(got.k, chunk.k.bfloat16().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_error_bound(tmp_path, dtype):
    """|x - x^| <= |x|/16 + s/1024 per element (s = head amax / 448), plus one rounding of
    the output dtype (2^-8 relative for bf16)."""
    chunk = make_chunk(3, T=64, dtype=dtype)
    chunk.k[1, :, 0] *= 50.0  # heads of very different scales
    chunk.v[2, :, 1] *= 1e-3
    with store_at(tmp_path, storage_dtype="fp8") as s:
        s.put(chunk)
        size = s.stats()["tiers"]["disk"]["bytes_used"]
    with store_at(tmp_path, storage_dtype="fp8") as s:
        got = s.get(chunk.key)
    out_rel = 0.0 if dtype == torch.float32 else 2.0**-8
    for x, y in ((chunk.k, got.k), (chunk.v, got.v)):
        x, y = x.float(), y.float()
        s_head = x.abs().amax(dim=(1, 3), keepdim=True) / 448.0  # (L, 1, Hkv, 1)
        bound = (x.abs() / 16 + s_head / 1024) * (1 + out_rel) + y.abs() * out_rel
        err = (x - y).abs()
        assert (err <= bound).all(), f"fp8 error {(err - bound).max().item():.3e} over the bound"
    # fp8 halves the bytes of bf16 (plus token ids, scales and header)
    with store_at(tmp_path / "bf16", storage_dtype="bf16") as s:
        s.put(chunk)
        bf16_size = s.stats()["tiers"]["disk"]["bytes_used"]
    assert size < 0.6 * bf16_size


def test_fp8_codec_zero_head_and_extremes():
    kv = torch.zeros(2, 5, 3, 4)
    kv[0, :, 1] = torch.tensor([448.0 * 7, -1e-6, 3.0, 0.0])
    q, scale = quantize_fp8(kv)
    assert scale.shape == (2, 3) and torch.isfinite(scale).all()
    out = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0


@pytest.mark.parametrize("storage", ["auto", "fp16", "fp8"])
def test_single_layer_reads_match_full(tmp_path, storage):
    chunk = make_chunk(4, L=5)
    with store_at(tmp_path, storage_dtype=storage) as s:
        s.put(chunk)
    with store_at(tmp_path, storage_dtype=storage, memory_bytes=0) as s:  # disk only
        full = s.get(chunk.key)
        before = s.disk.stats.bytes_read
        k, v = s.get_layer(chunk.key, 3)
        read = s.disk.stats.bytes_read - before
        assert torch.equal(k, full.k[3]) and torch.equal(v, full.v[3])
        layout = s.disk.layout(chunk.key)
        assert read == layout.layer_bytes  # only that layer's bytes
        if storage == "auto":
            assert torch.equal(k, chunk.k[3])


def test_layer_batch_into_preallocated_buffer(tmp_path):
    chunks = [make_chunk(10 + i, T=8 + i) for i in range(3)]
    with store_at(tmp_path) as s:
        for c in chunks:
            s.put(c)
    with store_at(tmp_path, memory_bytes=0) as s:
        keys = [c.key for c in chunks]
        T = sum(c.num_tokens for c in chunks)
        out_k = torch.full((T, 2, 8), float("nan"), dtype=torch.bfloat16)
        out_v = torch.full_like(out_k, float("nan"))
        batch = s.read_layer_batch(keys, 1, out_k=out_k, out_v=out_v)
        assert batch.k is out_k and batch.found == [True] * 3
        assert batch.offsets == [0, 8, 17, 27]
        assert torch.equal(out_k, torch.cat([c.k[1] for c in chunks]))
        assert torch.equal(out_v, torch.cat([c.v[1] for c in chunks]))
        missing = make_chunk(99)
        batch = s.read_layer_batch([keys[0], missing.key, keys[2]], 2)
        assert batch.found == [True, False, True] and batch.offsets == [0, 8, 8, 18]
        assert torch.equal(batch.k, torch.cat([chunks[0].k[2], chunks[2].k[2]]))


def test_returned_tensors_are_owned_by_caller(tmp_path):
    chunk = make_chunk(5)
    with store_at(tmp_path) as s:
        s.put(chunk)
        got = s.get(chunk.key)
        got.k.zero_()
        k, _ = s.get_layer(chunk.key, 0)
        k.zero_()
        assert torch.equal(s.get(chunk.key).k, chunk.k)


def test_files_are_plain_safetensors(tmp_path):
    chunk = make_chunk(6, dtype=torch.float32)
    with store_at(tmp_path, storage_dtype="fp8") as s:
        s.put(chunk)
        row = s.disk.manifest.lookup(chunk.key.to_string(), 1, "fp8")
        path = s.disk.root / row.path
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "qcfuse-kv" and meta["key"] == chunk.key.to_string()
        assert set(f.keys()) == {"token_ids", "scales", "layer.000", "layer.001", "layer.002"}
        assert f.get_tensor("layer.001").dtype == torch.float8_e4m3fn
        assert torch.equal(f.get_tensor("token_ids"), chunk.token_ids)


def test_header_checks_reject_mismatch():
    chunk, other = make_chunk(7), make_chunk(8)
    image = encode_chunk(chunk, "auto")
    header = bytes(image.data[: image.layout.data_start].numpy())
    assert parse_header(header, chunk.key, "auto") == image.layout
    with pytest.raises(EntryFormatError):
        parse_header(header, other.key, "auto")
    with pytest.raises(EntryFormatError):
        parse_header(header, chunk.key, "bf16")
    with pytest.raises(EntryFormatError):
        parse_header(header[:7], chunk.key, "auto")
    with pytest.raises(EntryFormatError):
        parse_header(header.replace(b'"BF16"', b'"F16 "'), chunk.key, "auto")


def test_bad_storage_names_raise():
    with pytest.raises(ValueError, match="valid: .*fp8"):
        stored_dtype("int4", torch.bfloat16)
    with pytest.raises(TypeError):
        stored_dtype("auto", torch.int32)


@pytest.mark.parametrize("storage", ["auto", "fp8"])
def test_layer_batch_from_memory_matches_layer_reads(tmp_path, storage):
    chunks = [make_chunk(20 + i, T=5 + i, dtype=torch.float32) for i in range(3)]
    with store_at(tmp_path, storage_dtype=storage) as s:
        for c in chunks:
            s.put(c)  # now in the host tier
        batch = s.read_layer_batch([c.key for c in chunks], 2)
        assert batch.found == [True] * 3 and batch.k.dtype == torch.float32
        for c, a, b in zip(chunks, batch.offsets, batch.offsets[1:]):
            k, v = s.get_layer(c.key, 2)
            assert torch.equal(batch.k[a:b], k) and torch.equal(batch.v[a:b], v)


@pytest.mark.parametrize("storage", ["auto", "fp8"])
def test_layer_batch_to_a_device_buffer_path(tmp_path, storage):
    """The device-output path (raw reads, copy, decode on the device) with the meta device
    standing in for CUDA: it runs and verifies; the data check is the GPU test's job."""
    chunks = [make_chunk(30 + i, T=6) for i in range(3)]
    with store_at(tmp_path, storage_dtype=storage) as s:
        for c in chunks:
            s.put(c)
    with store_at(tmp_path, storage_dtype=storage, memory_bytes=0) as s:
        out = torch.empty((18, 2, 8), dtype=torch.bfloat16, device="meta")
        batch = s.read_layer_batch([c.key for c in chunks], 1, out_k=out, out_v=out.clone())
        assert batch.found == [True] * 3 and s.disk.stats.hits == 3
        kv, scale = s.disk.read_layer_raw(chunks[0].key, 1)
        assert kv.shape == (2, 6, 2, 8) and (scale is None) == (storage == "auto")
        if storage == "auto":
            assert torch.equal(kv[0], chunks[0].k[1])
