"""Batched ingestion: many chunks per forward pass, store writes off the compute thread.

A chunk's cache is its prefill *alone* at positions 0..n-1 (`QCFuseEngine.prefill_alone`).
One chunk per forward leaves a GPU mostly idle: every GEMM gets only n rows and every
layer pays its kernel launches for them. Here a batch of chunks runs as one layer loop:

    chunks      [a a a a a] [b b] [c c c c]
    packed      a a a a a b b c c c c        norms, q/k/v, o_proj, MLP: once over all rows,
    positions   0 1 2 3 4 0 1 0 1 2 3        no padding; RoPE at each row's own position
    attention   a a a a a                    per layer, a right-padded (B, heads, n_max, D)
                b b . . .                    view under a causal mask: a real row sees the
                c c c c .                    keys of its own chunk up to itself, never the
                                             padding (.), which only padded rows read

Attention is the only step that mixes rows, so packing changes nothing but the GEMM shapes:
the result is each chunk's alone prefill up to float summation order. Keys are kept pre-RoPE
(after the q/k norm where the model has one), as `fused_prefill(capture_pre_rope=True)` keeps
them; the last layer stops after its q/k/v, since nothing after it reaches a cache.

Writing a chunk (anchors, encoding, the device -> host copy, disk, sidecar) runs on one
worker thread (`StoreWriter`) while the next batch computes:

    compute   [batch 0][batch 1][batch 2][batch 3] ...
    writer             [write 0][write 1][write 2] ...

The writer's queue holds at most `max_pending` jobs (one job per batch), so at most that
many batches of device tensors wait beside the one being computed. Every tensor handed to
the writer is its own: `prefill_alone_batch` returns fresh per-chunk copies, never views of
a buffer the compute thread reuses.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.model import ModelAdapter, to_device

log = logging.getLogger(__name__)

# Padded tokens per forward pass (`default_batch_tokens`). On a GPU, GEMMs reach their peak
# rate only with thousands of rows; 16K rows keep an H200 busy while a batch's activations
# and K/V stay small (Llama-8B: ~2 GiB of bf16 K/V, ~1.4 GiB of MLP activations).
# On a CPU, GEMMs are near their peak at a few hundred rows already, and the element-wise
# steps (norms, RoPE, SiLU gate) slow down once a batch's activations outgrow the caches:
# SmolLM2-135M bf16 on one core ran 1024- to 8192-token batches at the same rate, so the
# smallest of them is kept (less memory held, sooner first writes).
CUDA_BATCH_TOKENS = 16384
CPU_BATCH_TOKENS = 1024


# ----------------------------------------------------------------------------- batched prefill


@dataclass(frozen=True)
class _Packing:
    """Where each chunk's rows lie: in the packed rows and in the padded attention view."""

    spans: list[tuple[int, int]]  # chunk i -> rows [a, b) of the packed rows
    positions: torch.Tensor  # (N,) each row's position inside its chunk
    slots: torch.Tensor  # (N,) each row's row in the padded view: chunk * n_max + position
    num_chunks: int
    n_max: int

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device) -> "_Packing":
        n_max, ends = max(lengths), list(accumulate(lengths))
        positions = torch.cat([torch.arange(n) for n in lengths])
        chunk = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        idx = to_device(torch.stack([positions, chunk * n_max + positions]), device)
        return cls(list(zip([0, *ends[:-1]], ends)), idx[0], idx[1], len(lengths), n_max)

    @property
    def dense(self) -> bool:
        """Every chunk has n_max rows: the packed rows already are the padded view."""
        return self.spans[-1][1] == self.num_chunks * self.n_max

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed (N, heads, D) -> padded (B, heads, n_max, D), zeros in the padding."""
        B, n, tail = self.num_chunks, self.n_max, x.shape[1:]
        if not self.dense:
            x = x.new_zeros((B * n, *tail)).index_copy_(0, self.slots, x)
        return x.view(B, n, *tail).transpose(1, 2)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """Padded (B, heads, n_max, D) -> packed (N, heads, D)."""
        rows = y.transpose(1, 2).reshape(-1, y.shape[1], y.shape[3])
        return rows if self.dense else rows.index_select(0, self.slots)


def _attend(pack: _Packing, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            band: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every chunk's rows over its own keys: q (N, H, D), k, v (N, Hkv, D) -> (N, H, D).
    band: a sliding layer's (n_max, n_max) bool mask (see `_band`), None for full attention."""
    if band is None:
        out = F.scaled_dot_product_attention(pack.pad(q), pack.pad(k), pack.pad(v), is_causal=True,
                                             scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(pack.pad(q), pack.pad(k), pack.pad(v), attn_mask=band,
                                             scale=scale, enable_gqa=True)
    return pack.unpad(out)


def _band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """(n, n) bool: row i sees key j iff i - window < j <= i (a sliding layer over positions 0..n-1)."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _check_chunks(adapter: ModelAdapter, ids_list: Sequence[torch.Tensor]) -> list[int]:
    for ids in ids_list:
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"every chunk must be a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    return [int(ids.shape[0]) for ids in ids_list]


@torch.inference_mode()
def prefill_alone_batch(adapter: ModelAdapter, ids_list: Sequence[torch.Tensor],
                        sink: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every chunk alone at positions 0..n_i-1, in one layer loop -> per chunk (k_pre, v),
    each (L, n_i, Hkv, D) on the adapter's device: what `QCFuseEngine.prefill_alone` returns.

    sink: token ids each chunk is prefilled after (its own tokens then sit at positions
    s..s+n_i-1); their rows are dropped, so the cache still holds the chunk's tokens only
    (`EngineConfig.chunk_sink`: no chunk token is ever a sequence start).

    Each returned tensor owns its memory (safe to hand to another thread, or to keep in a
    store without holding the batch's buffers).
    """
    if not ids_list:
        return []
    if sink is not None and sink.numel():
        if sink.dim() != 1:
            raise ValueError(f"sink must be a 1-D tensor of token ids, got shape {tuple(sink.shape)}")
        _check_chunks(adapter, ids_list)
        s0 = int(sink.numel())
        out = prefill_alone_batch(adapter, [torch.cat([sink.to(ids.device, torch.int64), ids.to(torch.int64)])
                                            for ids in ids_list])
        return [(k[:, s0:].contiguous(), v[:, s0:].contiguous()) for k, v in out]
    lengths = _check_chunks(adapter, ids_list)
    pack = _Packing.of(lengths, adapter.device)
    s = adapter.shape
    k_all = torch.empty((s.num_layers, sum(lengths), s.num_kv_heads, s.head_dim), device=adapter.device,
                        dtype=adapter.dtype)
    v_all = torch.empty_like(k_all)
    ropes = adapter.rope_layers(pack.positions)  # per layer (N, D) cos, sin
    n_max = max(lengths)
    bands = {w: _band(n_max, w, adapter.device) for w in set(adapter.windows) if w is not None and w < n_max}
    h = adapter.embed(torch.cat([ids.to(torch.int64) for ids in ids_list]))  # (N, hidden)
    for layer in range(s.num_layers):
        q, k, v = adapter.qkv(layer, adapter.attn_norm(layer, h))
        k_all[layer], v_all[layer] = k, v
        if layer + 1 < s.num_layers:  # the last layer's output reaches no cache
            cos, sin = ropes[layer]
            band = bands.get(adapter.windows[layer])
            attn = _attend(pack, K.apply_rope(q, cos, sin), K.apply_rope(k, cos, sin), v, adapter.scale, band)
            h = adapter.mlp(layer, adapter.attn_out(layer, h, attn))
    return [(k_all[:, a:b].contiguous(), v_all[:, a:b].contiguous()) for a, b in pack.spans]


# ----------------------------------------------------------------------------- batch planning


def default_batch_tokens(device: torch.device | str) -> int:
    """Padded tokens per forward pass on `device` (see CUDA_BATCH_TOKENS / CPU_BATCH_TOKENS)."""
    return CUDA_BATCH_TOKENS if torch.device(device).type == "cuda" else CPU_BATCH_TOKENS


def plan_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Chunk indices grouped into batches of at most `max_batch_tokens` padded tokens
    (chunks in the batch x its longest chunk).

    Longest chunks first, so each batch holds chunks of similar length and pads little;
    equal lengths keep their input order. A chunk longer than the cap goes alone.
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
    model on the H200 while the batched prefill made ~45K (docs/benchmarks.md).
    """

    def __init__(self, *, max_pending: int = 2, synchronous: bool = False,
                 device: torch.device | str = "cpu", workers: int = 1) -> None:
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
    stream.wait_event(ready)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()  # the job's kernels are done with its tensors before they are freed
