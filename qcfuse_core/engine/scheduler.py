"""The scheduler: one worker thread owns the device and runs every request of an engine.

Why. Each caller used to run its own batch-1 prefill and decode loop on the one device:
eight users got their first token nine times later than one, and together were served at
half the rate of a queue (docs/benchmarks.md). A decode step is bound by reading the weights once,
whatever the number of sequences in it, so decoding every running request in one step is
nearly free throughput; and with one thread on the device no two requests fight over it.

    callers (threads, asyncio tasks)              the worker thread, one `step` after another
    submit -> Job -> waiting (<= max_queue)       1. drop aborted jobs: KV cache back to the
              EngineBusy when it is full             pool, load session closed
    stream <- the job's outbox: text deltas,      2. for each prefill the step's budget reaches:
              then the FusionResult or the           schedule     the step budget's rows,
              error of that request alone                         prefills under way oldest
    close / cancel -> the job's abort flag                        first, then waiting jobs
                                                                  admitted, tenants in turn
                                                                  (steps 1-4: lookup,
                                                                  KV reserved, plan, prompt,
                                                                  load session, rows: its
                                                                  `Prefill`)
                                                     run          `prefill.advance(rows)`
                                                     postprocess  a finished prefill: the
                                                                  guard's decision - a rung
                                                                  (or a rerun after an
                                                                  unreadable chunk) is the
                                                                  job's next Prefill, under
                                                                  the same budget - else its
                                                                  first token
                                                  3. one decode step for every decoding job:
                                                     run          the model runner
                                                                  (model/runner.py)
                                                     postprocess  each samples its own row

A request arrives as data - its `Prompt` (the pieces), method, ratio and generation config,
checked in the caller's thread; the worker never calls back to build it.
The scheduler decides what runs and keeps each request's state, and never calls back into
the steps but through `Steps.open`, `Prefill.advance`, `Steps.after` and `Steps.rerun`;
the model runner (`model.runner.ModelRunner`) runs the batched decode step - CUDA graphs on a GPU, eager
`decode_batch` otherwise or where a graph cannot be captured - and takes the plain greedy
rows' argmax together; the chunk lookup (`cache.chunks.ChunkLookup`) answers the lookup and
the KV budget (`cache.budget.KVBudget`) admits requests.

Requests join the batch when their prefill ends and leave it when they finish, between
steps (continuous batching). A request whose step raises fails alone: its caller gets the
error, the others go on (a batched decode step that raises is run again one sequence at a
time, to find the one it came from). All of a request's state is in its `Job` and `Request`;
the scheduler holds its queues and counters only. The worker thread exits after
IDLE_EXIT_S without work and starts again at the next submit.

A request's answer does not depend on its batch: in fp32 on a CPU the rounding differences
of a batched product are too small to flip a token (docs/determinism.md), and with
`EngineConfig.deterministic` decode_batch runs its row-wise work on blocks of
`deterministic_tile` rows, bit for bit as alone.

KV budget: a request is admitted only once its KV cache (prompt + max_new_tokens) fits
beside the running requests' within `CacheConfig.kv_cache_bytes` (on a GPU by default
`kv_memory_share` of the memory free at the first admission): `KVBudget.reserve` gives it
a reservation (its KV buffer: `Reservation.kv()`), released when it ends, or None - then it
waits at the head of the queue (counted as deferred) and admission ends for that step, so
nothing runs out of memory under load. One larger than the whole budget fails alone with KVBudgetError.

On a CUDA device the decode step is replayed from CUDA graphs (`model.graphs.GraphDecoder`,
`SchedulerConfig.cuda_graphs`); with `deterministic` it runs one bucket of `deterministic_tile`
rows, so a sequence's bits do not depend on its batch there either.

The step budget: a step runs at most its budget's rows of prefill, whoever they belong to -
a request's own pass, the guard's rungs, a rerun - so a long prompt holds the running
answers for a slice a step, never for its whole prefill. The budget is in time
(`SchedulerConfig.step_prefill_ms`, a default per device): its rows are sized at each step
from the prefills' measured cost (`PrefillRate`, engine/step_budget.py; before the first,
the planner's rate), so a step's prefill takes about that long on any machine and load; an
explicit `step_prefill_tokens` fixes the rows instead.

Fair admission: waiting requests are admitted tenant by tenant in turn (`Request.tenant`,
`_pick`: the tenant admitted least recently first), first in first out within a tenant, so
one tenant's flood cannot queue ahead of another's single request. In-process callers name
no tenant: one tenant, first in first out. A prefill with more rows
is split into slices by position (engine/prefill.py); its slices depend on its rows and
the budget only, so in deterministic mode its bits are the same alone or batched. The
first prefill of a step runs its next slice whatever its size (a prefill whose rows are
chosen during the layer loop, cacheblend's, is one slice), so every prefill moves.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from qcfuse_core.cache.budget import KVBudgetError as KVBudgetError
from qcfuse_core.cache.budget import Reservation
from qcfuse_core.engine.ahead import Ahead, ahead_ready, decoding_now, plan_ahead
from qcfuse_core.engine.generation import GenerationConfig
from qcfuse_core.engine.pipeline import Decoding, Steps, fusion_result
from qcfuse_core.engine.prefill import Prefill, Unreadable
from qcfuse_core.engine.request import Prefilled, Prompt, Request, StageClock, Status
from qcfuse_core.engine.step_budget import FALLBACK_STEP_PREFILL_TOKENS, PrefillRate, default_step_ms, step_rows
from qcfuse_core.engine.threads import configure_cpu_threads
from qcfuse_core.model.runner import ModelRunner
from qcfuse_core.types import FusionResult

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # stopped at interpreter exit


@atexit.register
def _shutdown_all() -> None:
    for scheduler in list(_LIVE):
        scheduler.shutdown()


IDLE_EXIT_S = 5.0  # the worker thread exits after this long without a request
ABORT_WAIT_S = 1.0  # how often a caller waiting for an abort checks that the worker lives
# background work starts only once no request has waited or run for this long: a client
# sending its requests one after another (a few ms apart) finds no piece under way
IDLE_WORK_AFTER_S = 0.25


class EngineBusy(RuntimeError):
    """The engine's queue is full: `SchedulerConfig.max_queue` requests already wait to be
    admitted. Raised when a request is submitted; nothing of it ran. Retry later, or raise
    `max_queue` (a deeper queue only makes each request wait longer)."""


@dataclass(frozen=True)
class Failed:
    """The last item of a request that failed: its caller raises `error`."""

    error: BaseException


@dataclass(frozen=True)
class SchedulerStats:
    """Counters since the scheduler started (`running` and `waiting`: now)."""

    submitted: int
    finished: int
    aborted: int
    failed: int
    running: int  # admitted: prefilling or decoding
    waiting: int
    steps: int
    max_batch_seen: int  # the most sequences one decode step has run
    deferred: int  # admissions put off because a KV cache did not fit yet
    prefill_slices: int  # slices of chunked prefills run (prompts split over several steps)
    idle_tasks: int  # background work run in idle steps (`submit_idle`: chunk builds)
    idle_waiting: int  # background work waiting for an idle step, now
    admitted: int  # requests admitted (given a Prefill; tenants in turn, `Scheduler._pick`)


@dataclass(eq=False)
class Job:
    """One submitted request as the scheduler sees it. `emit` hands the caller a text delta,
    then the FusionResult or a `Failed` (from the worker thread); `abort` is set by the
    caller (closed stream, cancelled task), `released` by the worker once the request's
    resources are given back."""

    request: Request
    prompt: Prompt
    emit: Callable[[object], object]
    abort: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    reservation: Reservation | None = None  # its KV cache's room in the budget, while it runs
    prefill: Prefill | None = None  # from admission to its first token (a guard rung, a rerun: a new one)
    decoding: Decoding | None = None  # from the first token on


class Scheduler:
    """Continuous batching of one engine's requests on one worker thread (module docstring):
    the requests run through `steps` (engine/pipeline.py), over their engine's model, caches
    and config."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.engine = steps.engine
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()  # guarded by _cv
        # tenant -> the number of its last admission, for tenants with requests waiting (`_pick`)
        self._turns: dict[str | None, int] = {}  # guarded by _cv
        self._running: list[Job] = []  # the worker's own; admitted jobs, prefilling or decoding
        self._thread: threading.Thread | None = None
        self._stopping = False  # set by shutdown(); submit refuses from then on
        _LIVE.add(self)
        self._counts = dict.fromkeys(
            (
                "submitted",
                "finished",
                "aborted",
                "failed",
                "steps",
                "max_batch_seen",
                "deferred",
                "prefill_slices",
                "idle_tasks",
                "admitted",
            ),
            0,
        )
        self._idle: deque[tuple[Callable[[], object], Future]] = deque()  # guarded by _cv
        self.idle_after_s = IDLE_WORK_AFTER_S  # quiet time before background work (`submit_idle`)
        self._busy_at = float("-inf")  # time.monotonic() of the last step that ran requests
        self.rate = PrefillRate()  # the prefills' measured ms per row: the step budget in time
        self.clock: Callable[[], float] = time.perf_counter  # times the prefills for `rate`
        self._rows = 0  # this step's budget in rows (`step_budget`), set at each step
        cfg = self.engine.config
        self.runner = ModelRunner(
            self.engine.adapter, cuda_graphs=cfg.scheduler.cuda_graphs, deterministic=cfg.deterministic
        )
        self._ahead: Ahead | None = None  # the decode step launched and not yet read (`_decode`)

    # ------------------------------------------------------------------ callers' side
    def submit(
        self,
        prompt: Prompt,
        method: str,
        ratio: float,
        gen: GenerationConfig,
        emit: Callable[[object], object],
        *,
        sync_stages: bool = False,
        started: float | None = None,
        guard: bool = True,
        tenant: str | None = None,
    ) -> Job:
        """Queue a request; its clock (and so its TTFT) starts now, or at `started`
        (`time.perf_counter()`); guard=False: the quality guard leaves it as fused; tenant:
        whose request it is (admitted in turn with other tenants', `_pick`). Raises
        EngineBusy when `max_queue` requests already wait."""
        engine = self.engine
        clock = StageClock(engine.adapter.device, sync_stages, started)
        job = Job(Request(method, ratio, gen, clock, guard=guard, tenant=tenant), prompt, emit)
        with self._cv:
            if self._stopping:
                raise RuntimeError(
                    "the engine's scheduler has shut down (engine.close(), or the interpreter is exiting)"
                )
            max_queue = engine.config.scheduler.max_queue
            if len(self._waiting) >= max_queue:
                raise EngineBusy(
                    f"{len(self._waiting)} requests already wait (SchedulerConfig.max_queue={max_queue}); retry later"
                )
            self._waiting.append(job)
            self._counts["submitted"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="qcfuse-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job

    def abort(self, job: Job, *, wait: bool = False) -> None:
        """End `job` early: at the next step it leaves the batch (or the queue), its KV cache
        goes back to the pool and its load session is closed. wait: return only once that
        is done (never from the worker thread, nor from an event loop)."""
        job.abort.set()
        with self._cv:
            self._cv.notify()
            worker = self._thread
        if not wait or worker is threading.current_thread():
            return
        while not job.released.wait(ABORT_WAIT_S):
            with self._cv:
                if self._thread is None:  # no worker: nothing holds the job's resources
                    return

    def submit_idle(self, work: Callable[[], object]) -> Future:
        """Queue background work (a chunk build) at the scheduler's lowest priority: the worker
        runs it in a step where no request waits or runs, one piece a step, so it never runs
        beside a live request's prefill or decode step; a request arriving meanwhile waits
        for the piece under way at most. A piece starts only once no request has waited or
        run for `idle_after_s` (IDLE_WORK_AFTER_S), so requests sent one after another find
        none under way. -> its Future (cancelled at shutdown if not run)."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError(
                    "the engine's scheduler has shut down (engine.close(), or the interpreter is exiting)"
                )
            self._idle.append((work, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="qcfuse-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify()
        return future

    def deltas(self, job: Job, get: Callable[[], object]) -> Generator[str, None, FusionResult]:
        """The text deltas of `job` from its outbox (`get` blocks for the next item); returns
        its FusionResult, raises its error. Closed early, it aborts the job and waits for
        its resources to be given back."""
        done = False
        try:
            while True:
                item = get()
                if isinstance(item, str):
                    yield item
                    continue
                done = True
                if isinstance(item, Failed):
                    raise item.error
                assert isinstance(item, FusionResult)
                return item
        finally:
            if not done:
                self.abort(job, wait=True)

    def stats(self) -> SchedulerStats:
        with self._cv:
            return SchedulerStats(
                **self._counts, running=len(self._running), waiting=len(self._waiting), idle_waiting=len(self._idle)
            )

    # ------------------------------------------------------------------ the worker
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the worker thread: requests still waiting or running are aborted. Called for
        every live scheduler when the interpreter exits (a daemon thread still inside a
        torch call while the interpreter finalises can abort the process)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            worker = self._thread
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                while not self._waiting and not self._running and not self._idle and not self._stopping:
                    if not self._cv.wait(IDLE_EXIT_S) and not self._waiting and not self._idle:
                        if self._thread is me:
                            self._thread = None
                        return
                stopping = self._stopping
            if stopping:
                with self._cv:
                    jobs = list(self._waiting) + list(self._running)
                    self._waiting.clear()
                    idle, self._idle = list(self._idle), deque()
                for _, future in idle:
                    future.cancel()
                for job in jobs:
                    job.abort.set()
                    self._release(job, Status.ABORTED)
                with self._cv:
                    if self._thread is me:
                        self._thread = None
                return
            try:
                self.step()
            except Exception as e:  # the scheduler's own bug: every admitted request gets it
                log.exception("scheduler step failed")
                for job in list(self._running):
                    self._release(job, Status.FAILED, e)

    def step(self) -> None:
        """One scheduler step (the worker thread's; see the module docstring): aborted jobs
        leave, then schedule -> run -> postprocess: for each prefill the step's budget
        reaches (oldest first; admissions last), then for one decode step of every
        decoding job. A step with no request waiting or running runs one piece of background
        work instead (`submit_idle`)."""
        self._drop_aborted()
        if self._run_idle():
            return
        self._rows = self.step_budget()
        for job, rows in self._schedule():
            pre = self._run(job, rows)
            if pre is not None:
                self._postprocess(job, pre)
        batch = [j for j in self._running if j.request.status is Status.DECODING and not j.abort.is_set()]
        if batch or self._ahead is not None:
            self._decode(batch)
        with self._cv:
            self._counts["steps"] += 1
            self._counts["max_batch_seen"] = max(self._counts["max_batch_seen"], len(batch))
            self._busy_at = time.monotonic()

    def _run_idle(self) -> bool:
        """One piece of background work, when no request waits or runs and none has for
        `idle_after_s` -> whether the step is done (a piece ran, or the worker waited for
        the quiet time to pass or a request to come)."""
        with self._cv:
            if self._waiting or self._running or not self._idle:
                return False
            quiet = time.monotonic() - self._busy_at
            if quiet < self.idle_after_s:
                self._cv.wait(self.idle_after_s - quiet)  # a submit wakes the worker
                return True
            work, future = self._idle.popleft()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(work())
            except Exception as e:  # the work's own error, for its submitter
                future.set_exception(e)
        with self._cv:
            self._counts["idle_tasks"] += 1
            self._counts["steps"] += 1
        return True

    # ------------------------------------------------------------------ schedule
    def _schedule(self) -> Iterator[tuple[Job, int]]:
        """The prefills this step runs and the rows each runs, from the step's budget
        (`step_budget`): those under way first, oldest first (a guard rung or a rerun takes its request's
        place), then waiting jobs admitted one at a time while rows are left (at most
        `max_running` running). A prefill whose next slice does not fit waits, and so does
        every one after it; the first prefill of a step runs its next slice whatever its
        size. Lazy: a job's first token leaves before the next job is admitted."""
        cfg = self.engine.config.scheduler
        left, seen = self._rows, set()
        while True:
            job = next((j for j in self._running if j.prefill is not None and id(j.prefill) not in seen), None)
            if job is None and left > 0 and len(self._running) < cfg.max_running:
                job = self._admit()
            if job is None or job.prefill is None:
                return
            seen.add(id(job.prefill))
            rows = job.prefill.grant(left, first=left == self._rows)
            if rows == 0:
                return
            left -= rows
            yield job, rows

    def _drop_aborted(self) -> None:
        """Aborted jobs leave: those still waiting leave the queue now, whatever its length."""
        with self._cv:
            gone = [j for j in self._waiting if j.abort.is_set()]
            for j in gone:
                self._waiting.remove(j)
            if gone:  # a tenant none of whose requests waits any more comes back as a new one
                waiting = {j.request.tenant for j in self._waiting}
                self._turns = {t: n for t, n in self._turns.items() if t in waiting}
        gone += [j for j in self._running if j.abort.is_set()]
        for j in gone:
            self._release(j, Status.ABORTED)

    def _admit(self) -> Job | None:
        """The next waiting job (`_pick`: tenants in turn), admitted with its Prefill
        (`_open`); None when none waits, or when it must wait for its KV cache to fit (it
        stays first in its tenant's line, and its tenant keeps its turn). A job that fails
        alone is released and the next one is tried."""
        while True:
            job = self._next_waiting()
            if job is None:
                return None
            self._open(job)
            if job.request.status is Status.WAITING:  # deferred: its KV cache does not fit yet
                return None
            with self._cv:  # its tenant's turn is taken
                tenant = job.request.tenant
                self._turns[tenant] = self._counts["admitted"]
                self._counts["admitted"] += 1
                if not any(j.request.tenant == tenant for j in self._waiting):
                    del self._turns[tenant]  # none of its requests waits: it comes back as a new tenant
            if job.prefill is not None:
                return job

    def _next_waiting(self) -> Job | None:
        """The next waiting job not aborted (`_pick`; aborted ones leave the queue now), or None."""
        while True:
            with self._cv:
                if not self._waiting:
                    return None
                job = self._pick()
                self._waiting.remove(job)
                self._running.append(job)  # counted as running from here (under the lock)
            if not job.abort.is_set():
                return job
            self._release(job, Status.ABORTED)

    def _pick(self) -> Job:
        """Fair admission (under the lock, some job waiting): the oldest waiting job of the
        tenant admitted least recently - a tenant with none admitted since its requests began
        waiting first, then the one whose last admission is oldest; ties go to the tenant
        whose oldest job waited longest. So tenants take turns, first in first out within
        each, and one tenant's flood cannot queue ahead of another's single request."""
        best, best_turn, seen = self._waiting[0], None, set()
        for job in self._waiting:  # oldest first: each tenant's first job is its oldest
            tenant = job.request.tenant
            if tenant in seen:
                continue
            seen.add(tenant)
            turn = self._turns.get(tenant, -1)
            if best_turn is None or turn < best_turn:
                best, best_turn = job, turn
        return best

    def _open(self, job: Job) -> None:
        """Steps 1-4 of `job`, its KV cache reserved once its prompt's length is known (after
        the lookup, before anything is loaded or allocated) -> its Prefill in `job.prefill`;
        WAITING at the queue's head again when its KV cache does not fit beside the running
        requests' yet; or released, FAILED."""
        req, engine = job.request, self.engine
        req.clock.mark("queue")
        req.status = Status.PREFILLING
        try:
            # CPU threads chosen per request, in the thread that runs it (engine/threads.py)
            req.threads = configure_cpu_threads(engine.adapter.device, threads=self.steps.request_threads)["threads"]
            looked = self.steps.request_lookup(job.prompt.pieces, req)
            job.reservation = engine.kv_budget.reserve(looked.num_tokens + req.generation.max_new_tokens)
            if job.reservation is None:
                self._defer(job)
                return
            req.cache = job.reservation.kv()  # the request's KV buffer: its prefills write into it
            loading = self.steps.prepare(looked, req)
            job.prefill = self.steps.open(job.prompt.pieces, req, loading, budget=self._slice_rows)
        except Exception as e:
            self._release(job, Status.FAILED, e)

    @property
    def _slice_rows(self) -> int:
        return self._rows or self.step_budget()

    def step_budget(self) -> int:
        """The rows of prefill one step runs now: `step_prefill_tokens` where set, else
        `step_prefill_ms` (None: the device's default) at the measured prefill cost - the
        scheduler's own, before its first prefill the planner's rate (engine/step_budget.py)."""
        cfg, rates = self.engine.config.scheduler, self.steps.rates
        ms = cfg.step_prefill_ms or default_step_ms(self.engine.adapter.device.type)
        prior = rates.prefill_ms_per_token if rates is not None else None
        return step_rows(self._fixed_rows(), ms, self.rate.cost(prior))

    def _fixed_rows(self) -> int | None:
        """The budget in rows where it is not timed: `step_prefill_tokens`; in deterministic
        mode without it FALLBACK_STEP_PREFILL_TOKENS (a prefill's slices set its bits, and
        must not depend on the clock)."""
        cfg = self.engine.config
        if cfg.scheduler.step_prefill_tokens is None and cfg.deterministic:
            return FALLBACK_STEP_PREFILL_TOKENS
        return cfg.scheduler.step_prefill_tokens

    def _defer(self, job: Job) -> None:
        """`job` waits again, at the head of the queue: the lookup done so far counts as
        waiting (it runs again when the job is admitted)."""
        req = job.request
        req.close()
        req.status = Status.WAITING
        req.clock.mark("queue")
        with self._cv:
            self._running.remove(job)
            self._waiting.appendleft(job)
            self._counts["deferred"] += 1

    # ------------------------------------------------------------------ run
    def _run(self, job: Job, rows: int) -> Prefilled | None:
        """`rows` rows of `job`'s prefill -> its Prefilled once its last slice has run, else
        None. A chunk that could not be read makes the job's Prefill again (`Steps.rerun`);
        any other error fails the job alone."""
        prefill = job.prefill
        assert prefill is not None
        try:
            t0 = self.clock()
            pre = prefill.advance(rows)
            self._observe(prefill, rows, t0)
            if prefill.sliced:
                with self._cv:
                    self._counts["prefill_slices"] += 1
            return pre
        except Unreadable as e:
            try:
                job.prefill = self.steps.rerun(prefill, e, budget=self._slice_rows)
            except Exception as e2:
                self._release(job, Status.FAILED, e2)
        except Exception as e:
            self._release(job, Status.FAILED, e)
        return None

    def _observe(self, prefill: Prefill, rows: int, t0: float) -> None:
        """The prefill rate, from `rows` granted to `prefill` since `t0` (the rows it
        recomputed: a prefill in one slice is charged its prompt's length but recomputes its
        selected rows; its loads and probe count in its time, so the rate errs slow). Only
        where the budget is in time (on CUDA the device is waited for, to time its work)."""
        if self._fixed_rows() is not None:
            return
        if self.engine.adapter.device.type == "cuda":
            torch.cuda.synchronize(self.engine.adapter.device)
        computed = rows if prefill.sliced else int(prefill.rows.numel())
        self.rate.observe((self.clock() - t0) * 1e3, computed)

    def _run_decode(self, batch: list[Job]) -> list[torch.Tensor | None]:
        """One decode step of the decoding jobs on the model runner -> per job its logits row,
        or None where the step failed it (released). A batched step that raises runs again
        one job at a time, so an error stays with the job it came from."""
        caches = [j.request.cache for j in batch]
        tokens = [j.decoding.token for j in batch if j.decoding is not None]
        assert len(tokens) == len(batch) and all(c is not None for c in caches)  # decoding jobs
        try:
            rows = self.runner.decode(caches, tokens)  # type: ignore[arg-type]
            return [rows[b] for b in range(len(batch))]
        except Exception as e:
            if len(batch) == 1:
                self._release(batch[0], Status.FAILED, e)
                return [None]
            log.warning("a batched decode step failed (%s); running its %d sequences one by one", e, len(batch))
        out: list[torch.Tensor | None] = []
        for job, cache, token in zip(batch, caches, tokens):
            try:
                out.append(self.runner.decode([cache], [token])[0])  # type: ignore[list-item]
            except Exception as e1:
                self._release(job, Status.FAILED, e1)
                out.append(None)
        return out

    # ------------------------------------------------------------------ decode one step ahead (t64)
    def _decode(self, batch: list[Job]) -> None:
        """One decode step of `batch`. Device-side sampling (`SchedulerConfig.decode_ahead`)
        when every job is plain greedy: the step is launched with each job of the step before
        fed its token there, on the device; then the step before is read and its tokens taken
        (`engine.ahead`). Otherwise the step before is read first and the step runs and is
        read at once."""
        prev, self._ahead = self._ahead, None
        if not (self._decode_ahead and batch and ahead_ready(batch)):
            if prev is not None:
                self._take_ahead(prev)
            batch = [j for j in batch if decoding_now(j)]  # the step before may have finished some
            if batch:
                self._take_tokens(batch, self._run_decode(batch))
            return
        go, tokens, feed = plan_ahead(batch, prev)
        try:
            launched = self.runner.launch([j.request.cache for j in go], tokens, feed) if go else None  # type: ignore[misc]
        except Exception as e:  # read the step before, then run this one the plain way
            log.debug("a decode step launched ahead failed (%s); running it again plainly", e)
            if prev is not None:
                self._take_ahead(prev)
            batch = [j for j in batch if decoding_now(j)]
            if batch:
                self._take_tokens(batch, self._run_decode(batch))
            return
        if prev is not None:
            self._take_ahead(prev)
        if launched is not None:
            self._ahead = Ahead(go, launched)

    @property
    def _decode_ahead(self) -> bool:
        return bool(self.engine.config.scheduler.decode_ahead)  # None: off (SchedulerConfig)

    def _take_ahead(self, ahead: Ahead) -> None:
        """The tokens of a step launched ahead, each taken by its job; a job that finished or
        left since it was launched has its row dropped."""
        for job, token in zip(ahead.jobs, ahead.launched.tokens()):
            if not decoding_now(job):
                continue
            try:
                assert job.decoding is not None
                delta = job.decoding.take_token(token)
            except Exception as e:
                self._release(job, Status.FAILED, e)
                continue
            self._advance(job, delta)

    # ------------------------------------------------------------------ postprocess
    def _postprocess(self, job: Job, pre: Prefilled) -> None:
        """A finished prefill: the guard's decision (`Steps.after`) - a rung is the job's next
        Prefill, run under the same budget - else its first token, and it decodes from the
        next step on."""
        engine, req = self.engine, job.request
        try:
            assert job.prefill is not None
            job.prefill = self.steps.after(job.prefill, pre, budget=self._slice_rows)
            if job.prefill is not None:
                return
            req.clock.mark("prefill")
            job.decoding = Decoding(engine, pre, req)
            delta = job.decoding.first()
        except Exception as e:
            job.prefill = None
            self._release(job, Status.FAILED, e)
            return
        req.status = Status.DECODING
        self._advance(job, delta)

    def _take_tokens(self, batch: list[Job], rows: list[torch.Tensor | None]) -> None:
        """Each decoding job's token from its row of the step (its sampler; plain greedy rows
        by one argmax over the batch); a job whose row failed has been released."""
        done = [(job, row) for job, row in zip(batch, rows) if row is not None]
        greedy = [
            i for i, (job, _) in enumerate(done) if job.decoding is not None and job.decoding.sampler.plain_greedy
        ]
        picks: dict[int, int] = {}
        if len(greedy) > 1:
            picks = dict(zip(greedy, self.runner.argmax([done[i][1] for i in greedy])))
        for i, (job, row) in enumerate(done):
            try:
                assert job.decoding is not None
                delta = job.decoding.take_token(picks[i]) if i in picks else job.decoding.take(row)
            except Exception as e:
                self._release(job, Status.FAILED, e)
                continue
            self._advance(job, delta)

    def _advance(self, job: Job, delta: str) -> None:
        if delta:
            self._emit(job, delta)
        if job.decoding is not None and job.decoding.finish is not None:
            self._release(job, Status.FINISHED)

    def _emit(self, job: Job, item: object) -> None:
        try:
            job.emit(item)
        except Exception:  # the caller's event loop is gone: nobody reads this request
            log.debug("request output could not be delivered; aborting it", exc_info=True)
            job.abort.set()

    def _release(self, job: Job, status: Status, error: BaseException | None = None) -> None:
        """End `job` with `status`: its resources given back, its counters, then its caller
        told (the result or the error; nothing when aborted, the caller has gone)."""
        req, engine = job.request, self.engine
        job.prefill = None
        out: object = None
        if status is Status.FINISHED:
            assert job.decoding is not None
            try:
                out = fusion_result(engine, job.decoding.pre, req, job.decoding)
            except Exception as e:
                status, error = Status.FAILED, e
        try:
            req.close()
        except Exception as e:  # a load session that fails to close fails its request only
            if status is not Status.ABORTED:
                status, error = Status.FAILED, e
        finally:
            req.cache = None
            engine.kv_budget.release(job.reservation)  # its buffer back to the pool, its room to the chunk tier
            job.reservation = None
        req.status = status
        with self._cv:
            if job in self._running:
                self._running.remove(job)
            self._counts[status.value] += 1
        if status is Status.FAILED:
            assert error is not None
            self._emit(job, Failed(error))
        elif status is Status.FINISHED:
            self._emit(job, out)
        job.released.set()
