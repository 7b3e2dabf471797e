"""Ingestion: every chunk's cache computed alone, store writes off the compute thread.

A chunk's cache is a pure function of its tokens: its prefill *alone* at positions 0..n-1,
one forward pass of exactly its n rows (`prefill_alone`). The store is addressed by content,
so the same tokens must give the same bits whoever computes them - ingestion, a request
that misses, a rebuild after damage, another process or replica.

Packing several chunks into one forward (rows of all chunks through each GEMM, attention
over a padded view) was faster on a GPU but not batch-invariant: a GEMM's kernel and its
summation order depend on the number of rows it gets (cuBLAS picks tiles and split-K by
shape; the CPU's BLAS blocks by shape), and a padded attention reduces in blocks sized by
the longest chunk. On the CPU with SmolLM2-135M in bf16, a 30-token chunk packed beside a
38- and a 33-token one differed from its alone prefill by up to 0.19 in K and 0.14 in V -
a different cache under the same key, and after a rebuild a different answer. So each chunk
runs alone, with the shapes its alone prefill has and nothing else: the same bits in any
batch, in any order, on any thread count that gives them alone (tests/test_determinism.py).
Its cost on a GPU is measured in docs/benchmarks.md (ingestion tokens/s).

Keys are kept pre-RoPE (after the q/k norm where the model has one), as
`fused_prefill(capture_pre_rope=True)` keeps them; the last layer stops after its q/k/v,
since nothing after it reaches a cache.

Writing a chunk (anchors, encoding, the device -> host copy, disk, sidecar) runs on
worker threads (`StoreWriter`) while the next chunks compute:

    compute   [batch 0][batch 1][batch 2][batch 3] ...
    writer             [write 0][write 1][write 2] ...

A batch (`plan_batches`) is the unit handed to the writers: its chunks' caches wait in
device memory until written, and the writer's queue holds at most `max_pending` jobs, so
the memory in flight stays bounded. Every tensor handed to the writer owns its memory.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.model.adapter import ModelAdapter, to_device

log = logging.getLogger(__name__)

# Tokens per batch handed to the writers (`default_batch_tokens`): how much of the caches
# computed waits in memory for its write. On a GPU a batch of 16K tokens of Llama-8B holds
# ~2 GiB of bf16 K/V; on a CPU a smaller batch gives sooner first writes.
CUDA_BATCH_TOKENS = 16384
CPU_BATCH_TOKENS = 1024


# ----------------------------------------------------------------------------- the alone prefill


def _band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """(n, n) bool: row i sees key j iff i - window < j <= i (a sliding layer over positions 0..n-1)."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _check_chunks(ids_list: Sequence[torch.Tensor]) -> list[int]:
    for ids in ids_list:
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"every chunk must be a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    return [int(ids.shape[0]) for ids in ids_list]


def _check_sink(sink: torch.Tensor | None) -> int:
    if sink is None or not sink.numel():
        return 0
    if sink.dim() != 1:
        raise ValueError(f"sink must be a 1-D tensor of token ids, got shape {tuple(sink.shape)}")
    return int(sink.numel())


@torch.inference_mode()
def prefill_alone(
    adapter: ModelAdapter, ids: torch.Tensor, sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's cache: its tokens alone at positions 0..n-1 -> (k_pre, v), each
    (L, n, Hkv, D) on the adapter's device, owning their memory.

    sink: token ids the chunk is prefilled after (its own tokens then sit at positions
    s..s+n-1); their rows are dropped, so the cache still holds the chunk's tokens only
    (`CacheConfig.chunk_sink`: no chunk token is ever a sequence start).
    """
    (n,) = _check_chunks([ids])
    s0 = _check_sink(sink)
    if s0:
        assert sink is not None
        ids = torch.cat([sink.to(ids.device, torch.int64), ids.to(torch.int64)])
    n = s0 + n
    s = adapter.shape
    k_all = torch.empty((s.num_layers, n, s.num_kv_heads, s.head_dim), device=adapter.device, dtype=adapter.dtype)
    v_all = torch.empty_like(k_all)
    ropes = adapter.rope_layers(to_device(torch.arange(n), adapter.device))  # per layer (n, D) cos, sin
    bands: dict[int | None, torch.Tensor] = {
        w: _band(n, w, adapter.device) for w in set(adapter.windows) if w is not None and w < n
    }
    h = adapter.embed(to_device(ids.to(torch.int64), adapter.device))  # (n, hidden)
    for layer in range(s.num_layers):
        q, k, v = adapter.qkv(layer, adapter.attn_norm(layer, h))
        k_all[layer], v_all[layer] = k, v
        if layer + 1 < s.num_layers:  # the last layer's output reaches no cache
            cos, sin = ropes[layer]
            qr, kr = K.apply_rope(q, cos, sin), K.apply_rope(k, cos, sin)
            band = bands.get(adapter.windows[layer])
            # (n, heads, D) -> (1, heads, n, D): causal (or banded) attention over the chunk's own keys
            attn = F.scaled_dot_product_attention(
                qr.transpose(0, 1)[None],
                kr.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=band is None,
                attn_mask=band,
                scale=adapter.scale,
                enable_gqa=True,
            )
            h = adapter.mlp(layer, adapter.attn_out(layer, h, attn[0].transpose(0, 1)))
    if s0:
        return k_all[:, s0:].contiguous(), v_all[:, s0:].contiguous()
    return k_all, v_all


def prefill_alone_batch(
    adapter: ModelAdapter, ids_list: Sequence[torch.Tensor], sink: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`prefill_alone` of every chunk -> per chunk (k_pre, v): bit for bit what each gives
    alone, in any batch and any order (see the module docstring for why not packed)."""
    _check_chunks(ids_list)
    _check_sink(sink)
    return [prefill_alone(adapter, ids, sink) for ids in ids_list]


# ----------------------------------------------------------------------------- batch planning


def default_batch_tokens(device: torch.device | str) -> int:
    """Tokens per batch on `device` (see CUDA_BATCH_TOKENS / CPU_BATCH_TOKENS)."""
    return CUDA_BATCH_TOKENS if torch.device(device).type == "cuda" else CPU_BATCH_TOKENS


def plan_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Chunk indices grouped into batches of at most `max_batch_tokens` tokens, counted as
    chunks in the batch x its longest chunk (a bound on the K/V a batch holds until written).

    Longest chunks first; equal lengths keep their input order. A chunk longer than the cap
    goes alone. A batch's chunks are still each computed alone (`prefill_alone_batch`).
    """
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if any(n < 1 for n in lengths):
        raise ValueError("chunk lengths must be >= 1")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(i)  # the batch's first chunk is its longest
        else:
            batches.append([i])
    return batches


# ----------------------------------------------------------------------------- background writes


_Job = tuple[Callable[..., object], tuple, torch.cuda.Event | None]  # fn, args, ready event


class StoreWriter:
    """Runs store writes in submission order on one worker thread (or inline).

        with StoreWriter(device=adapter.device) as writer:
            for batch in batches:
                chunks = compute(batch)
                writer.submit(write_all, chunks)      # returns at once unless the queue is full
        # here every write has run; the first failure is raised

    `submit` blocks while `max_pending` jobs wait, bounding the device memory in flight.
    After a job fails, later jobs are skipped and `submit` raises at once (no more compute
    for writes that will not happen); `close` waits for the queue and raises that error.
    Jobs run under `torch.inference_mode`, as the compute thread does.

    CUDA (`device`): a job waits for the work its submitter had queued (an event recorded at
    `submit`) and runs on the writer's own stream, so its copies overlap the next batch's
    compute; the stream is synchronised before the job's tensors are released.

    synchronous: jobs run inside `submit`, which raises their errors itself (tests; a CPU,
    where a writer thread competes with the compute threads for the cores).

    workers > 1: that many threads (each with its own stream) run jobs concurrently, in no
    particular order. A chunk's write is mostly waiting - pinning host memory for the host
    tier, the file write and its fsync - and one thread wrote only ~4K tokens/s of an 8B
    model on the H200 while the prefill computed an order of magnitude more (docs/benchmarks.md).
    """

    def __init__(
        self, *, max_pending: int = 2, synchronous: bool = False, device: torch.device | str = "cpu", workers: int = 1
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.synchronous = synchronous
        self._device = torch.device(device)
        self._error: BaseException | None = None
        self._closed = False
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending)
        self._threads: list[threading.Thread] = []
        self._error_lock = threading.Lock()
        for i in range(0 if synchronous else workers):
            stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
            t = threading.Thread(target=self._work, args=(stream,), name=f"qcfuse-store-writer-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, fn: Callable[..., object], *args) -> None:
        """Run `fn(*args)` after every job submitted before it."""
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        self._raise_error()
        if self.synchronous:
            with torch.inference_mode():
                fn(*args)
            return
        self._jobs.put((fn, args, self._ready_event()))

    def close(self) -> None:
        """Wait until every submitted job has run (or been skipped after a failure); raise
        the first job's error if one failed."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
            for t in self._threads:
                t.join()
        self._raise_error()

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body failed: still write what it submitted, and let its error propagate
            self.close()
        except BaseException as err:
            if err is not exc:
                log.error("store writer failed as well", exc_info=err)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _ready_event(self) -> torch.cuda.Event | None:
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _work(self, stream: torch.cuda.Stream | None) -> None:
        for job in iter(self._jobs.get, None):
            if self._error is None:
                err = _run(job, stream)
                if err is not None:
                    with self._error_lock:
                        self._error = self._error or err
            del job  # release its tensors before waiting for the next


def _run(job: _Job, stream: torch.cuda.Stream | None) -> BaseException | None:
    """Run one job -> its error, if any (re-raised by StoreWriter.close)."""
    fn, args, ready = job
    try:
        with torch.inference_mode(), _on_stream(stream, ready):
            fn(*args)
    except BaseException as err:  # noqa: BLE001 - handed to the submitting thread
        return err
    return None


@contextmanager
def _on_stream(stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None) -> Iterator[None]:
    """Run the block on `stream` once `ready` has fired; wait for its work before leaving."""
    if stream is None:
        yield
        return
    assert ready is not None  # a stream exists only on CUDA, where every job has its event
    stream.wait_event(ready)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()  # the job's kernels are done with its tensors before they are freed
