"""What one request is: what it asks, what it owns, and the immutable results of its steps.

The steps themselves, and their table, are in engine/pipeline.py (`Steps`: 1 lookup, 2 plan,
3 start loading, 4 select, 5 fuse, 6 decode); the scheduler (engine/scheduler.py) drives
them for every request of the engine's API. Defined here: the results of steps 2-5
(`Planned`, `Loading`, `Selected`, `Prefilled`; step 1's, `LookedUp`, is the cache manager's
answer, cache/lookup.py), what a request asks (`Prompt`) and what it owns (`Request`, its
`Status` and `StageClock`).

What a request asks is data: a `Prompt` (its pieces), built and checked on the caller's
thread - an empty question, a bad ratio or an unknown method raises there, before anything
is queued - and handed to the scheduler as is.

A `Request` carries what belongs to one request only: its status, method, ratio, generation
config, stage clock and the load session to close in a `finally` - never the engine. A
request that fails leaves nothing behind, so the next one is unaffected.

    WAITING -> PREFILLING -> DECODING -> FINISHED        (the scheduler, engine/scheduler.py)
       |            |            |
       +------------+------------+-----> ABORTED | FAILED

Stage timings are consecutive intervals from the request's submission to its first token
(the first, `queue`, is the wait for the scheduler to admit it), so they always add up to
the TTFT. On a GPU the work of a stage may still be running when the
next one starts (that overlap is the point of layer-wise loading); `sync_stages=True` waits
for the compute stream at every stage boundary, so each stage shows its own device time
(at the price of that overlap).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from qcfuse_core.engine.generation import GenerationConfig
from qcfuse_core.model.fusion import FusedPrompt, KVCache
from qcfuse_core.types import GuardReport, Piece, SelectionResult

STAGES = ("queue", "lookup", "plan", "load_start", "select", "prefill", "first_token")
PIECE_KINDS = ("prefix", "chunk", "text", "suffix")


@dataclass(frozen=True)
class Prompt:
    """What one request asks: its prompt's pieces in order (`Piece`: prefix, chunks with their
    node ids, text, suffix), checked when it is made - on the caller's thread."""

    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pieces", tuple(self.pieces))
        if not self.pieces:
            raise ValueError("a prompt needs at least one piece")
        for p in self.pieces:
            if not isinstance(p, Piece) or p.kind not in PIECE_KINDS:
                raise ValueError(f"a prompt is made of Pieces of kind {', '.join(PIECE_KINDS)}; got {p!r}")


class Status(enum.Enum):
    """Where a request is in its life; FINISHED, ABORTED and FAILED are final."""

    WAITING = "waiting"  # queued, nothing computed
    PREFILLING = "prefilling"  # steps 1-5 and the first token
    DECODING = "decoding"  # one token per scheduler step
    FINISHED = "finished"  # eos, a stop string or max_new_tokens
    ABORTED = "aborted"  # its caller closed the stream
    FAILED = "failed"  # a step raised; the error went to its caller

    @property
    def final(self) -> bool:
        return self in (Status.FINISHED, Status.ABORTED, Status.FAILED)


@dataclass(frozen=True)
class Planned:
    method: str  # `full` when the planner decided nothing fused can win
    recompute: frozenset[int]  # chunk numbers (prompt order) recomputed whole instead of loaded
    plan: dict[str, Any] = field(default_factory=dict)  # planner.Plan.to_dict(); {} without rates


@dataclass(frozen=True)
class Loading:
    prompt: FusedPrompt
    session: Any = None  # prefetch.LoadSession streaming the chunks' layers, or None (in memory)


@dataclass(frozen=True)
class Selected:
    selection: SelectionResult


@dataclass(frozen=True)
class Prefilled:
    logits: torch.Tensor  # (logits_last, vocab) fp32: the last rows of the prefill
    cache: KVCache  # the prompt's fused cache, ready to decode from
    prompt: FusedPrompt  # the prompt actually fused (a recovered request's differs)
    selection: SelectionResult
    recomputed_tokens: int
    hits: int
    misses: int
    load_report: dict[str, Any] = field(default_factory=dict)


class StageClock:
    """Consecutive stage intervals of one request, from `t0` (`time.perf_counter()`; default:
    now), in ms."""

    def __init__(self, device: torch.device, sync: bool = False, t0: float | None = None) -> None:
        self.device, self.sync = device, sync and device.type == "cuda"
        self.t0 = self._last = time.perf_counter() if t0 is None else t0
        self.stages: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        """Close `stage` now (after the compute stream drains, when syncing)."""
        if self.sync:
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        self.stages[f"{stage}_ms"] = self.stages.get(f"{stage}_ms", 0.0) + (now - self._last) * 1e3
        self._last = now

    def since_start_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3


@dataclass
class Request:
    """What one request owns (mutable, never shared): see the module docstring."""

    method: str
    ratio: float
    generation: GenerationConfig
    clock: StageClock
    status: Status = Status.WAITING
    session: Any = None  # the open LoadSession, closed in the engine's `finally`
    plan: dict[str, Any] = field(default_factory=dict)  # the planner's decision (Planned.plan)
    cache: KVCache | None = None  # the request's fused cache (given back to the engine's pool at its end)
    threads: int = 0  # CPU intra-op threads it ran with (threads.configure_cpu_threads)
    extra: dict[str, float] = field(default_factory=dict)  # sub-measures (load_wait_ms, ...)
    guard: bool = True  # the quality guard may escalate it (and the engine's GuardConfig is on)
    guard_report: GuardReport | None = None  # what the guard saw and did (engine/guard.py)
    guard_row_ms: float = 0.0  # its first fused pass's time per row (the guard's time ceiling)
    asked: tuple[str, float] = ("", 0.0)  # the method and ratio its caller asked for (set at construction)
    tenant: str | None = None  # whose request: the scheduler admits tenants in turn (None: the one shared tenant)

    def __post_init__(self) -> None:
        self.asked = (self.method, self.ratio)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
