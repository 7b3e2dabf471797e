"""The engine's fixed settings: one frozen, validated config (per-request values are arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qcfuse_core.selection.options import QCFuseOptions

DEFAULT_SYSTEM = "You are a helpful assistant. Answer the question using only the documents provided."


@dataclass(frozen=True)
class EngineConfig:
    """What stays the same for every request of an engine.

    method / ratio: the defaults a request overrides. selection_options: `QCFuseOptions`
    keywords (critical_layers, anchor_method, anchor_share, budget, ...) - or an instance -
    validated here, so an unknown option fails at construction, naming the valid ones.
    chunk_sink: cache every chunk after the tokenizer's BOS token (dropped from the cache),
    under its own key fingerprint; off by default (on Gemma-3-270M's musique_s it closed
    58.5% of naive's KL gap at 0.3 against 83.1% with plain caches).
    deterministic: a request's tokens do not depend on what else runs - decode steps run
    their row-wise operations on fixed blocks of rows (`model.batched.decode_batch`, batched
    or alone alike) and CPU threads are chosen once, when the engine starts, instead of per
    request from the machine's load (docs/determinism.md; its cost in docs/benchmarks.md).
    Without it a request repeated on an idle machine is still identical, and chunk caches
    are always batch-invariant.
    max_queue / max_running / step_prefill_tokens: the scheduler's bounds (engine/scheduler.py).
    At most `max_queue` requests wait to be admitted - one more raises `EngineBusy` at submit
    instead of growing without bound; at most `max_running` are prefilled or decoding at once;
    one scheduler step starts new requests until their prompts reach `step_prefill_tokens`
    (at least one per step), so new prompts do not stall the running requests' decode for long.
    batched_prefill: the requests one scheduler step admits are prefilled together - their
    chunk loads shared, one probe pass, one ragged fused prefill whose products run over all
    their rows (engine/pipeline.py `Steps.prefill_batch`). A request's logits then agree
    with its logits alone to float tolerance; with `deterministic` the row-wise work runs
    request by request (bit for bit as alone) and only the loads and the layer loop are
    shared. Off (the default), each admitted request is prefilled alone: on the CPU machine
    batching made bursts no faster and full prefill slower (docs/benchmarks.md, "Requests
    fused together"), and its GPU paths await their H200 run.
    cuda_graphs: on a CUDA device the scheduler replays its decode steps from CUDA graphs
    (`model.graphs.GraphDecoder`); off, or where a step cannot be captured, it decodes eagerly.
    kv_cache_bytes / kv_memory_share: the bytes the running requests' KV caches may hold
    together. A request is admitted only when its cache (prompt + max_new_tokens) fits beside
    theirs; until then it waits, and one that could never fit fails with KVBudgetError.
    None: on a CUDA device `kv_memory_share` of the memory free when the scheduler starts; on
    a CPU no limit.
    promote_disk_reads: after a request streamed chunks from the disk tier, copy them into the
    memory tiers in the background, so the next request using them reads memory (what a
    server wants; `qcfuse serve` turns it on). Off, the disk tier is read each time (what a
    benchmark of the disk tier wants).
    """

    method: str = "qcfuse"
    ratio: float = 0.15
    system_prompt: str = DEFAULT_SYSTEM
    context_header: str = "Documents:\n\n"
    glue: str = "\n\n"
    question_template: str = "\n\nQuestion: {question}\nAnswer in one short sentence."
    seed: int = 0
    # CPU intra-op threads for every request (None: engine/threads.py's policy - the user's
    # own setting, else torch's default capped at the cores other work leaves idle)
    threads: int | None = None
    selection_options: dict[str, Any] = field(default_factory=dict)
    chunk_sink: bool = False
    deterministic: bool = False
    max_queue: int = 256
    max_running: int = 32
    step_prefill_tokens: int = 8192
    batched_prefill: bool = False
    cuda_graphs: bool = True
    kv_cache_bytes: int | None = None
    kv_memory_share: float = 0.8
    promote_disk_reads: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if "{question}" not in self.question_template:
            raise ValueError("question_template must contain '{question}'")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads must be a positive int or None, got {self.threads!r}")
        if not isinstance(self.chunk_sink, bool):
            raise ValueError(f"chunk_sink must be True or False, got {self.chunk_sink!r}")
        for name in ("deterministic", "cuda_graphs", "promote_disk_reads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("max_queue", "max_running", "step_prefill_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.kv_cache_bytes is not None and (
            isinstance(self.kv_cache_bytes, bool) or not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 1
        ):
            raise ValueError(f"kv_cache_bytes must be a positive int or None, got {self.kv_cache_bytes!r}")
        if not 0.0 < self.kv_memory_share <= 1.0:
            raise ValueError(f"kv_memory_share must be in (0, 1], got {self.kv_memory_share!r}")
        opts = self.selection_options
        if isinstance(opts, QCFuseOptions):
            object.__setattr__(self, "selection_options", opts.to_options())
        elif not isinstance(opts, dict):
            raise TypeError(f"selection_options must be a dict or QCFuseOptions, got {type(opts).__name__}")
        else:
            QCFuseOptions.from_options(opts, strict=True)

    @property
    def options(self) -> QCFuseOptions:
        """The selection options, parsed."""
        return QCFuseOptions.from_options(self.selection_options)
