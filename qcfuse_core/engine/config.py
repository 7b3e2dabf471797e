"""The engine's fixed settings: one frozen, validated config, split by concern.

    EngineConfig        method, ratio, seed, threads, deterministic, and one sub-config per concern:
      frame             FrameConfig      how a question and its documents become a prompt
      scheduler         SchedulerConfig  the scheduler's bounds and how it runs steps
      cache             CacheConfig      the KV budget and how chunk caches are kept
      selection         QCFuseOptions    the query-aware selectors' options
      guard             GuardConfig      the quality guard (engine/guard.py)
      audit             AuditConfig      the audit of live traffic (engine/audit.py)
    fidelity            the answer-token agreement with full prefill wanted (None: the fixed ratio)

Each is frozen and checked when it is made, so a bad value fails at construction, naming
what is wrong. Per-request values (method, ratio, generation) are arguments of a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qcfuse_core.engine.audit import AuditConfig, check_fidelity
from qcfuse_core.engine.guard import GuardConfig
from qcfuse_core.model.fusion import check_kv_dtype
from qcfuse_core.selection.options import OTHER_OPTIONS, QCFuseOptions

DEFAULT_SYSTEM = "You are a helpful assistant. Answer the question using only the documents provided."


def _check_bools(cfg: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(cfg, name)!r}")


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


@dataclass(frozen=True)
class FrameConfig:
    """The prompt frame (engine/frame.py): [chat head + system_prompt + context_header]
    [doc 1][glue][doc 2] ... [question_template with the question + chat tail]."""

    system_prompt: str = DEFAULT_SYSTEM
    context_header: str = "Documents:\n\n"
    glue: str = "\n\n"
    question_template: str = "\n\nQuestion: {question}\nAnswer in one short sentence."

    def __post_init__(self) -> None:
        if "{question}" not in self.question_template:
            raise ValueError("question_template must contain '{question}'")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's bounds (engine/scheduler.py).

    max_queue / max_running: at most `max_queue` requests wait to be admitted - one more
    raises `EngineBusy` at submit instead of growing without bound; at most `max_running` are
    prefilled or decoding at once.
    step_prefill_ms / step_prefill_tokens: the step budget - the prefill one scheduler step
    runs before the running answers get their next token, so a new prompt stalls them for a
    step's budget, never for its whole prefill. A step admits new requests while rows are
    left (at least one per step), and a prefill recomputing more rows than the budget is
    split by position into slices of at most that many rows, one step's worth each, the
    running requests decoding between them (engine/scheduler.py).
    step_prefill_ms: the budget in time - the rows are sized from the measured prefill rate
    so that a step's prefill takes about this long (engine/step_budget.py). None: the
    device's default, 1000 ms on a CPU (measured: a 2.8K-token prompt beside a running answer
    stalls it under half its prefill alone, and `bench load` keeps its throughput;
    docs/benchmarks.md) and none on a GPU, which keeps 8192 rows until a time budget is measured there
    (benchmarks/gpu.sh `crowd`).
    step_prefill_tokens: a fixed budget in rows instead; it overrides step_prefill_ms. In
    deterministic mode (`EngineConfig.deterministic`) the budget is never timed (a prefill's
    slices set its bits): step_prefill_tokens, else 8192 rows.
    Smaller budgets bound a running answer's stall more tightly at the cost of more passes
    over the weights per prompt.
    cuda_graphs: on a CUDA device the scheduler replays its decode steps from CUDA graphs
    (`model.graphs.GraphDecoder`); off, or where a step cannot be captured, it decodes eagerly.
    decode_ahead: device-side sampling - plain greedy decode steps choose their tokens on the
    device, feed them to the next step there and are read back one step late, so the host
    does not wait between steps (engine/ahead.py; answers token for token the same). None
    (the default): off. It saves about 2.5% of a step on the H100 (docs/benchmarks.md) and
    its GPU test (tests/test_kv_fp8.py, benchmarks/gpu.sh `crowd`) has not yet run on a card,
    so it is an option until it has. Useful only with CUDA graphs (elsewhere the host waits
    for each step anyway).
    """

    max_queue: int = 256
    max_running: int = 32
    step_prefill_tokens: int | None = None
    step_prefill_ms: float | None = None
    cuda_graphs: bool = True
    decode_ahead: bool | None = None

    def __post_init__(self) -> None:
        _check_bools(self, "cuda_graphs")
        if self.decode_ahead is not None and not isinstance(self.decode_ahead, bool):
            raise ValueError(f"decode_ahead must be True, False or None, got {self.decode_ahead!r}")
        for name in ("max_queue", "max_running", "step_prefill_tokens"):
            v = getattr(self, name)
            if not _positive_int(v) and not (name == "step_prefill_tokens" and v is None):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        ms = self.step_prefill_ms
        if ms is not None and (
            isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0
        ):
            raise ValueError(f"step_prefill_ms must be a positive number of milliseconds or None, got {ms!r}")


@dataclass(frozen=True)
class CacheConfig:
    """How the engine keeps KV caches (cache/budget.py, cache/chunks.py, the store's tiers).

    kv_cache_bytes / kv_memory_share: the bytes the running requests' KV caches may hold
    together. A request is admitted only when its cache (prompt + max_new_tokens) fits beside
    theirs; until then it waits, and one that could never fit fails with KVBudgetError.
    None: on a CUDA device `kv_memory_share` of the memory free when the scheduler starts; on
    a CPU no limit.
    The same budget holds the store's GPU chunk tier: what the running requests' caches do
    not hold keeps chunks on the GPU, and chunk entries give way when a request needs the
    room (cache/budget.py; the tier's sizes: store/sizing.py).
    promote_disk_reads: after a request streamed chunks from the disk tier, copy them into the
    memory tiers in the background (from their second use on, `StoreConfig.admission`), so
    the next request using them reads memory (on by default). Off, the disk tier is read
    each time (what a benchmark of the disk tier wants).
    chunk_sink: cache every chunk after the tokenizer's BOS token (dropped from the cache),
    under its own key fingerprint; off by default (docs/design.md, "Why these defaults").
    kv_dtype: the running requests' KV caches - "auto", the model's dtype (bf16 on a GPU), or
    "fp8": float8_e4m3fn with one fp32 scale per token and KV head, about half the bytes, so
    a decode step reads half the K and V and twice the requests fit (model/fusion.py
    `KVCache`). The fused prefill writes the codes, the decode step reads them (`qcfuse serve
    --kv-dtype fp8`). Its answers against bf16 KV, and why it is not the default:
    docs/benchmarks.md, "Decode at the card's limit".
    """

    kv_cache_bytes: int | None = None
    kv_memory_share: float = 0.8
    promote_disk_reads: bool = True
    chunk_sink: bool = False
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kv_dtype(self.kv_dtype)
        if not isinstance(self.chunk_sink, bool):
            raise ValueError(f"chunk_sink must be True or False, got {self.chunk_sink!r}")
        _check_bools(self, "promote_disk_reads")
        if self.kv_cache_bytes is not None and not _positive_int(self.kv_cache_bytes):
            raise ValueError(f"kv_cache_bytes must be a positive int or None, got {self.kv_cache_bytes!r}")
        if not 0.0 < self.kv_memory_share <= 1.0:
            raise ValueError(f"kv_memory_share must be in (0, 1], got {self.kv_memory_share!r}")


@dataclass(frozen=True)
class EngineConfig:
    """What stays the same for every request of an engine.

    method / ratio: the defaults a request overrides. seed: the selectors' seed (`random`).
    threads: CPU intra-op threads for every request (None: engine/threads.py's policy - the
    user's own setting, else torch's default capped at the cores other work leaves idle).
    deterministic: a request's tokens do not depend on what else runs - decode steps run
    their row-wise operations on fixed blocks of rows (`model.batched.decode_batch`, batched
    or alone alike) and CPU threads are chosen once, when the engine starts, instead of per
    request from the machine's load (docs/determinism.md; its cost in docs/benchmarks.md).
    Without it a request repeated on an idle machine is still identical, and chunk caches
    are always batch-invariant.
    frame / scheduler / cache: the sub-configs above. selection: `QCFuseOptions` (a dict of
    its keywords is accepted and parsed here, so an unknown option fails at construction,
    naming the valid ones).

        EngineConfig(ratio=0.3, scheduler=SchedulerConfig(max_running=8),
                     selection=QCFuseOptions(critical_layers=(5, 8)))
    """

    method: str = "qcfuse"
    ratio: float = 0.15
    seed: int = 0
    threads: int | None = None
    deterministic: bool = False
    frame: FrameConfig = field(default_factory=FrameConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    selection: QCFuseOptions = field(default_factory=QCFuseOptions)
    guard: GuardConfig = field(default_factory=GuardConfig)  # the quality guard (engine/guard.py)
    audit: AuditConfig = field(default_factory=AuditConfig)  # the audit of live traffic (engine/audit.py)
    # the answer-token agreement with full prefill wanted: a request that names no ratio gets
    # the cheapest configuration the audit shows meets it (engine/audit.py); None: `ratio`
    fidelity: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if self.threads is not None and not _positive_int(self.threads):
            raise ValueError(f"threads must be a positive int or None, got {self.threads!r}")
        _check_bools(self, "deterministic")
        for name, kind in (
            ("frame", FrameConfig),
            ("scheduler", SchedulerConfig),
            ("cache", CacheConfig),
            ("guard", GuardConfig),
            ("audit", AuditConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "selection", as_selection(self.selection))
        object.__setattr__(self, "fidelity", check_fidelity(self.fidelity))


def as_selection(options: QCFuseOptions | dict[str, Any]) -> QCFuseOptions:
    """`QCFuseOptions`, or a dict of its keywords parsed into one (an unknown key raises,
    naming the valid ones)."""
    if isinstance(options, QCFuseOptions):
        return options
    if not isinstance(options, dict):
        raise TypeError(f"selection must be a dict or QCFuseOptions, got {type(options).__name__}")
    other = sorted(set(options) & OTHER_OPTIONS)
    if other:
        raise ValueError(f"selection options {other} belong to other selectors, not to QCFuseOptions")
    return QCFuseOptions.from_options(options, strict=True)
