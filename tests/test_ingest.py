"""Batched ingestion: prefill_alone_batch gives each chunk HF's own cache of it alone on every
architecture; plan_batches respects its cap and covers every chunk once; StoreWriter keeps
order, bounds its queue, writes everything before close returns and raises what failed."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import qcfuse_kernels as K

from qcfuse_core.ingest.prefill import (CPU_BATCH_TOKENS, CUDA_BATCH_TOKENS, StoreWriter, default_batch_tokens,
                                plan_batches, prefill_alone, prefill_alone_batch)
from qcfuse_core.store import open_store
from qcfuse_core.model.testing import TINY_CONFIGS, tiny_model
from qcfuse_core.types import ChunkKey, KVChunk

ATOL = 1e-5  # fp32
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_ATOL = 2e-3  # fp32 on a GPU: the compiled kernels' products may round through TF32
LENGTHS = [17, 1, 32, 5]  # ragged, not sorted


def _chunks(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _assert_hf(adapter, ids_list, batched, atol: float = ATOL) -> None:
    """Each chunk's (k_pre, v) equals HF's own cache of the chunk alone (an independent
    forward; keys rotated back from pre-RoPE by the adapter's rotary at positions 0..n-1)."""
    assert len(batched) == len(ids_list)
    for i, (ids, (k_pre, v)) in enumerate(zip(ids_list, batched)):
        _, kv = adapter.hf_forward(ids)
        assert k_pre.shape[:2] == (len(kv), len(ids)) and v.shape == k_pre.shape, f"chunk {i}"
        for layer, (k_hf, v_hf) in enumerate(kv):
            cos, sin = adapter.rope(torch.arange(len(ids)), layer)
            k = K.apply_rope(k_pre[layer], cos, sin)
            where = f"chunk {i} (n={len(ids)}) layer {layer}"
            assert _max_diff(k, k_hf) <= atol, f"{where}: k differs by {_max_diff(k, k_hf):.2e}"
            assert _max_diff(v[layer], v_hf) <= atol, f"{where}: v differs by {_max_diff(v[layer], v_hf):.2e}"


# ----------------------------------------------------------------------------- prefill_alone_batch


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_batch_equals_hf_per_chunk(arch):
    """Ragged chunks (one of a single token) on every architecture, each equal to HF's
    forward of that chunk alone."""
    m = tiny_model(arch)
    ids_list = _chunks(LENGTHS)
    _assert_hf(m, ids_list, prefill_alone_batch(m, ids_list))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_batch_equals_hf_per_chunk_on_cuda(arch):
    """The same on the GPU, through the compiled kernels: each chunk equal to HF's forward of
    it alone on the same device (fp32; the kernels' products may round through TF32)."""
    m = tiny_model(arch)
    m.model.to("cuda")
    ids_list = _chunks([300, 1, 77, 512, 5])
    _assert_hf(m, ids_list, prefill_alone_batch(m, ids_list), atol=CUDA_ATOL)


def test_batch_is_order_independent_and_each_chunk_owns_its_memory():
    m = tiny_model("llama")
    ids_list = _chunks(LENGTHS, seed=3)
    fwd = prefill_alone_batch(m, ids_list)
    rev = prefill_alone_batch(m, ids_list[::-1])[::-1]
    for (k, v), (k2, v2) in zip(fwd, rev):
        assert _max_diff(k, k2) <= ATOL and _max_diff(v, v2) <= ATOL
        for t in (k, v):  # no view of a batch-wide buffer: the store keeps only this chunk's bytes
            assert t.is_contiguous()
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_batch_rejects_bad_chunks():
    m = tiny_model("llama")
    assert prefill_alone_batch(m, []) == []
    with pytest.raises(ValueError, match="non-empty"):
        prefill_alone_batch(m, [torch.arange(4), torch.arange(0)])
    with pytest.raises(ValueError, match="1-D"):
        prefill_alone_batch(m, [torch.arange(4).view(2, 2)])


@pytest.mark.parametrize("arch", ["gemma3", "mistral-swa"])
def test_batch_of_chunks_longer_than_the_window_equals_hf(arch):
    """Sliding layers inside batched ingestion: ragged chunks, some longer than the window,
    each equal to HF's own cache of the chunk alone (keys rotated back to pre-RoPE)."""
    m = tiny_model(arch)
    g = torch.Generator().manual_seed(7)
    chunks = [torch.randint(0, m.shape.vocab_size, (n,), generator=g) for n in (30, 5, 17, 12)]
    _assert_hf(m, chunks, prefill_alone_batch(m, chunks))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral-swa"])
def test_a_sink_prefix_is_prefilled_before_every_chunk_and_dropped(arch):
    """sink: each chunk's cache is the prefill of sink + chunk alone with the sink's rows
    dropped (windowed layers included: gemma3's window is 12, the chunks reach 32)."""
    m = tiny_model(arch)
    ids_list, sink = _chunks(LENGTHS), torch.tensor([7, 3])
    got = prefill_alone_batch(m, ids_list, sink=sink)
    plain = prefill_alone_batch(m, ids_list)
    for i, (ids, (k, v)) in enumerate(zip(ids_list, got)):
        k_ref, v_ref = prefill_alone(m, torch.cat([sink, ids]))
        assert k.shape == (k_ref.shape[0], len(ids), *k_ref.shape[2:]) and k.is_contiguous()
        assert _max_diff(k, k_ref[:, 2:]) <= ATOL and _max_diff(v, v_ref[:, 2:]) <= ATOL, f"chunk {i}"
    assert _max_diff(got[2][1], plain[2][1]) > 1e-3  # the sink changes what the chunk's rows saw
    assert prefill_alone_batch(m, ids_list, sink=torch.tensor([], dtype=torch.int64))[0][0].shape == plain[0][0].shape
    with pytest.raises(ValueError, match="1-D"):
        prefill_alone_batch(m, ids_list, sink=torch.tensor([[7]]))


# ----------------------------------------------------------------------------- plan_batches


def _padded(batch: list[int], lengths: list[int]) -> int:
    return len(batch) * max(lengths[i] for i in batch)


@pytest.mark.parametrize("seed", range(5))
def test_plan_respects_the_cap_and_covers_every_chunk_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 600) for _ in range(rng.randint(1, 80))]
    cap = 1024
    batches = plan_batches(lengths, cap)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert b, "empty batch"
        assert _padded(b, lengths) <= cap
    # greedy: no batch could have taken the next batch's first (longest) chunk
    for b, nxt in zip(batches, batches[1:]):
        assert (len(b) + 1) * max(lengths[i] for i in b) > cap


def test_plan_groups_similar_lengths_and_puts_an_over_long_chunk_alone():
    lengths = [1000, 10, 5000, 1000, 10, 999]
    assert plan_batches(lengths, 2000) == [[2], [0, 3], [5, 1], [4]]
    assert plan_batches(lengths, 3000) == [[2], [0, 3, 5], [1, 4]]
    assert plan_batches([], 100) == []
    with pytest.raises(ValueError):
        plan_batches([4], 0)
    with pytest.raises(ValueError):
        plan_batches([4, 0], 100)


def test_default_batch_tokens():
    assert default_batch_tokens("cuda") == default_batch_tokens(torch.device("cuda", 0)) == CUDA_BATCH_TOKENS
    assert default_batch_tokens("cpu") == CPU_BATCH_TOKENS < CUDA_BATCH_TOKENS


# ----------------------------------------------------------------------------- StoreWriter


def _slow_append(out: list, i: int) -> None:
    time.sleep(random.random() * 0.002)
    out.append(i)


def test_writer_keeps_order_and_finishes_before_close_returns():
    done: list[int] = []
    with StoreWriter(max_pending=3) as w:
        for i in range(60):
            w.submit(_slow_append, done, i)
    assert done == list(range(60))


def test_writer_runs_off_the_calling_thread_in_inference_mode():
    seen: list[tuple[int, bool]] = []
    with StoreWriter() as w:
        w.submit(lambda: seen.append((threading.get_ident(), torch.is_inference_mode_enabled())))
    assert seen and seen[0][0] != threading.get_ident() and seen[0][1]


def test_writer_reraises_the_first_error_and_skips_later_jobs():
    ran: list[int] = []

    def fail(msg: str) -> None:
        raise ValueError(msg)

    gate = threading.Event()
    w = StoreWriter(max_pending=8)
    w.submit(gate.wait, 10)  # hold the worker until everything is queued
    w.submit(ran.append, 1)
    w.submit(fail, "first")
    w.submit(fail, "second")
    w.submit(ran.append, 2)
    gate.set()
    with pytest.raises(ValueError, match="first"):
        w.close()
    assert ran == [1]
    with pytest.raises(ValueError, match="first"):  # the error stays
        w.close()


def test_writer_submit_fails_fast_after_an_error():
    w = StoreWriter()
    w.submit(lambda: 1 / 0)
    deadline = time.monotonic() + 10
    with pytest.raises(ZeroDivisionError):
        while time.monotonic() < deadline:  # once the worker has failed, submit raises
            w.submit(time.sleep, 0.001)
    with pytest.raises(ZeroDivisionError):
        w.close()


def test_writer_error_surfaces_through_the_with_block():
    with pytest.raises(ZeroDivisionError):
        with StoreWriter() as w:
            w.submit(lambda: 1 / 0)


def test_writer_body_error_propagates_after_pending_writes_ran():
    done: list[int] = []
    with pytest.raises(KeyError):
        with StoreWriter() as w:
            w.submit(_slow_append, done, 0)
            raise KeyError("compute failed")
    assert done == [0]


def test_writer_queue_is_bounded():
    release, started = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        release.wait(10)

    w = StoreWriter(max_pending=1)
    w.submit(block)
    assert started.wait(10)  # the worker holds job 1; the queue is empty
    w.submit(lambda: None)  # fills the queue
    third = threading.Thread(target=w.submit, args=(lambda: None,))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "submit did not wait for room in the queue"
    release.set()
    third.join(10)
    assert not third.is_alive()
    w.close()


def test_synchronous_writer_runs_inline_and_raises_at_once():
    seen: list[int] = []
    with StoreWriter(synchronous=True) as w:
        w.submit(lambda: seen.append(threading.get_ident()))
        assert seen == [threading.get_ident()]
        with pytest.raises(ValueError):
            w.submit(int, "not a number")
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(seen.append, 0)


def test_writer_fills_a_tiered_store_from_its_thread(tmp_path):
    """Batched caches written by the worker into a disk-backed store read back intact."""
    m = tiny_model("llama")
    store = open_store(tmp_path / "kv", gpu_bytes=0, use_cuda=False)
    ids_list = _chunks([12, 3, 7, 12], seed=5)
    lengths = [len(ids) for ids in ids_list]
    chunks: list[KVChunk] = []
    with StoreWriter(device=m.device) as w:
        for batch in plan_batches(lengths, 24):
            kvs = prefill_alone_batch(m, [ids_list[i] for i in batch])
            made = [KVChunk(ChunkKey.for_tokens(m.fingerprint(), ids_list[i]), ids_list[i], k, v)
                    for i, (k, v) in zip(batch, kvs)]
            chunks += made
            w.submit(lambda cs: [store.put(c) for c in cs], made)
    assert len(chunks) == 4
    for c in chunks:
        got = store.get(c.key)
        assert got is not None and torch.equal(got.token_ids, c.token_ids)
        assert torch.equal(got.k, c.k) and torch.equal(got.v, c.v)


# ----------------------------------------------------------------------------- CUDA (skipped without it)



@pytest.mark.gpu
@cuda
def test_cuda_writer_stores_what_was_computed_while_compute_goes_on(tmp_path):
    """The writer's copies wait for the compute that made the tensors and keep them alive
    until done, while the compute thread drops its references and fills fresh memory."""
    m = tiny_model("llama")
    m.model.to("cuda")
    store = open_store(tmp_path / "kv", gpu_bytes=0, use_cuda=True)
    ids_list = _chunks([257] * 12, seed=6)
    expect: dict[ChunkKey, tuple[torch.Tensor, torch.Tensor]] = {}
    with StoreWriter(device="cuda") as w:
        for batch in plan_batches([len(i) for i in ids_list], 3 * 257):
            made = []
            for i, (k, v) in zip(batch, prefill_alone_batch(m, [ids_list[i] for i in batch])):
                key = ChunkKey.for_tokens(m.fingerprint(), ids_list[i])
                expect[key] = (k.cpu(), v.cpu())
                made.append(KVChunk(key, ids_list[i], k, v))
            w.submit(lambda cs: [store.put(c) for c in cs], made)
            del made, k, v
            junk = [torch.full((64 << 20,), float("nan"), device="cuda") for _ in range(4)]  # reuse freed blocks
            del junk
    for key, (k, v) in expect.items():
        got = store.get(key)
        assert got is not None and torch.equal(got.k.cpu(), k) and torch.equal(got.v.cpu(), v)


def test_writer_with_several_workers_runs_every_job_once_concurrently():
    import threading
    import time

    done, names = [], set()
    lock = threading.Lock()

    def job(i):
        time.sleep(0.05)  # waiting, as a file write does: the workers overlap
        with lock:
            done.append(i)
            names.add(threading.current_thread().name)

    t0 = time.perf_counter()
    with StoreWriter(max_pending=8, workers=4) as w:
        for i in range(8):
            w.submit(job, i)
    assert sorted(done) == list(range(8)) and len(names) > 1
    assert time.perf_counter() - t0 < 8 * 0.05  # not one after another
    with pytest.raises(ValueError, match="workers"):
        StoreWriter(workers=0)
