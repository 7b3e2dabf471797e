"""The server's Prometheus metrics, in a registry of its own (two apps in one process - tests -
never share counters). Request metrics are recorded as requests end; the scheduler's state is
read at scrape time (a collector over `Scheduler.stats()`), so a gauge is never stale.

    qcfuse_requests_total{route, outcome}       ok | aborted | busy | bad_request | error
    qcfuse_http_responses_total{route, status}  every HTTP response by status, 4xx and 5xx included
                                                (validation.py StatusCounts, the outermost middleware)
    qcfuse_ttft_seconds{route}                  request start -> first token (the engine's clock)
    qcfuse_e2e_seconds{route}                   request received -> last byte of the answer
    qcfuse_prompt_tokens_total, qcfuse_completion_tokens_total
    qcfuse_cache_hits_total, qcfuse_cache_misses_total        chunks served from / without a cache
    qcfuse_recomputed_tokens_total, qcfuse_context_tokens_total
    qcfuse_recompute_share                      per request: recomputed / context tokens
    qcfuse_guard_escalations_total{action, reason}
                                                requests whose first-token margin was below the
                                                quality guard's threshold: what it did (ratio R,
                                                full, kept) and why (low_margin, ceiling)
    qcfuse_queue_length, qcfuse_running_requests              now (scheduler)
    qcfuse_max_batch_seen                       the most sequences one decode step has run
    qcfuse_scheduler_steps_total                scheduler steps run
    qcfuse_scheduler_requests_total{state}      submitted | finished | aborted | failed | deferred
    qcfuse_kv_pool_idle_bytes                   KV buffers pooled for reuse (idle)
    qcfuse_learned_chunks, qcfuse_learned_pending   learned texts held, spans queued or building
    qcfuse_learned_bytes, qcfuse_learned_max_bytes  their caches' bytes in the store; the budget
    qcfuse_learned_tenants                      tenants holding learned texts
    qcfuse_learned_{builds,hits,misses,evicted,dropped,failed}_total
                                                the learner's counters (qcfuse_core/learn.py)
    qcfuse_fidelity_agreement{fingerprint, config, bound}
                                                the audit's answer-token agreement with full
                                                prefill (engine/audit.py): bound = mean | low |
                                                high (its 95% interval), per configuration
    qcfuse_fidelity_first_token_agreement{fingerprint, config}
    qcfuse_fidelity_samples_total{fingerprint, config}     answers checked, per configuration
    qcfuse_fidelity_{audited,shadow,dropped,failed}_total  the audit's checks: live samples,
                                                shadow samples, dropped from a full backlog, failed
    qcfuse_fidelity_waiting                     checks waiting for idle capacity
    qcfuse_fidelity_target                      EngineConfig.fidelity (absent: none)
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.learn import ChunkLearner
from qcfuse_core.types import FusionResult

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SHARE_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
OUTCOMES = ("ok", "aborted", "busy", "bad_request", "error")


class _SchedulerCollector:
    """Gauges and counters read from the engine's scheduler when /metrics is scraped."""

    def __init__(self, engine: QCFuseEngine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        s = stats.scheduler
        for name, doc, value in (
            ("qcfuse_queue_length", "requests waiting to be admitted", s.waiting),
            ("qcfuse_running_requests", "requests admitted (prefilling or decoding): the running batch", s.running),
            ("qcfuse_max_batch_seen", "the most sequences one decode step has run", s.max_batch_seen),
            ("qcfuse_kv_pool_idle_bytes", "KV buffers pooled for reuse", stats.kv_pooled_bytes),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        steps = CounterMetricFamily("qcfuse_scheduler_steps", "scheduler steps run")
        steps.add_metric([], s.steps)
        yield steps
        states = CounterMetricFamily("qcfuse_scheduler_requests", "requests by scheduler state", labels=["state"])
        for state in ("submitted", "finished", "aborted", "failed", "deferred"):
            states.add_metric([state], getattr(s, state))
        yield states


class ServeMetrics:
    """One app's metrics (see the module docstring)."""

    def __init__(self, engine: QCFuseEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("qcfuse_requests", "requests by route and outcome", ["route", "outcome"], registry=r)
        self.responses = Counter(
            "qcfuse_http_responses", "HTTP responses by route and status", ["route", "status"], registry=r
        )
        self.on_finished: list[Callable[[FusionResult], None]] = []  # called with each finished request's result
        self.ttft = Histogram(
            "qcfuse_ttft_seconds", "time to first token", ["route"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "qcfuse_e2e_seconds", "request received to answer complete", ["route"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("qcfuse_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("qcfuse_completion_tokens", "tokens generated", registry=r)
        self.cache_hits = Counter("qcfuse_cache_hits", "chunks whose cache was stored before the request", registry=r)
        self.cache_misses = Counter("qcfuse_cache_misses", "chunks without a stored cache", registry=r)
        self.recomputed = Counter("qcfuse_recomputed_tokens", "context tokens recomputed", registry=r)
        self.context = Counter("qcfuse_context_tokens", "context tokens of fused prompts", registry=r)
        self.guard = Counter(
            "qcfuse_guard_escalations",
            "requests the quality guard found diverging, by what it did and why",
            ["action", "reason"],
            registry=r,
        )
        self.share = Histogram(
            "qcfuse_recompute_share", "recomputed / context tokens per request", buckets=SHARE_BUCKETS, registry=r
        )
        r.register(_SchedulerCollector(engine))  # type: ignore[arg-type]
        r.register(FidelityCollector(engine))  # type: ignore[arg-type]

    def outcome(self, route: str, outcome: str) -> None:
        self.requests.labels(route, outcome).inc()

    def status(self, route: str, status: int) -> None:
        self.responses.labels(route, str(status)).inc()

    def finished(self, route: str, result: FusionResult, seconds: float) -> None:
        self.outcome(route, "ok")
        for listener in self.on_finished:
            listener(result)
        self.ttft.labels(route).observe(result.ttft_ms / 1000.0)
        self.e2e.labels(route).observe(seconds)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.completion_tokens.inc(len(result.token_ids))
        self.cache_hits.inc(result.cache_hits)
        self.cache_misses.inc(result.cache_misses)
        self.recomputed.inc(result.recomputed_tokens)
        self.context.inc(result.context_tokens)
        if result.context_tokens:
            self.share.observe(result.recompute_share)
        g = result.guard
        if g is not None and g.code in ("low_margin", "ceiling"):
            self.guard.labels(g.action, g.code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LearnedCollector:
    """The learner's counters (`ChunkLearner.stats()`), read at scrape time."""

    def __init__(self, learner: ChunkLearner) -> None:
        self.learner = learner

    def collect(self):
        s = self.learner.stats()
        for name, doc, value in (
            ("qcfuse_learned_chunks", "chunk texts learned from prompts, held now", s.learned),
            ("qcfuse_learned_pending", "learned spans queued or building", s.pending),
            ("qcfuse_learned_bytes", "bytes of the learned texts' caches in the store", s.bytes),
            ("qcfuse_learned_max_bytes", "the bytes learned caches may hold", self.learner.max_bytes),
            ("qcfuse_learned_tenants", "tenants holding learned texts", s.tenants),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        for name, doc, value in (
            ("builds", "learned spans whose cache was built", s.builds),
            ("hits", "learned chunks served from their cache", s.hits),
            ("misses", "context spans computed because no cache held them yet", s.misses),
            ("evicted", "learned texts forgotten past the limit (index and store)", s.evicted),
            ("dropped", "spans not queued: too many builds waiting", s.dropped),
            ("failed", "learned spans whose build failed", s.failed),
        ):
            c = CounterMetricFamily(f"qcfuse_learned_{name}", doc)
            c.add_metric([], value)
            yield c


class FidelityCollector:
    """The audit's ledger and counters (`engine.stats().fidelity`), read at scrape time."""

    def __init__(self, engine: QCFuseEngine) -> None:
        self.engine = engine

    def collect(self):
        f = self.engine.audit.stats(self.engine.config.method)
        fp = f["fingerprint"]
        agree = GaugeMetricFamily(
            "qcfuse_fidelity_agreement",
            "answer-token agreement with full prefill measured by the audit (mean, 95% interval)",
            labels=["fingerprint", "config", "bound"],
        )
        first = GaugeMetricFamily(
            "qcfuse_fidelity_first_token_agreement",
            "first-token agreement with full prefill",
            labels=["fingerprint", "config"],
        )
        samples = CounterMetricFamily(
            "qcfuse_fidelity_samples", "answers the audit checked", labels=["fingerprint", "config"]
        )
        for label, c in f["configs"].items():
            samples.add_metric([fp, label], c["n"])
            if c["agree"] is None:
                continue
            agree.add_metric([fp, label, "mean"], c["agree"])
            if c["agree_ci"] is not None:
                agree.add_metric([fp, label, "low"], c["agree_ci"][0])
                agree.add_metric([fp, label, "high"], c["agree_ci"][1])
            first.add_metric([fp, label], c["first_agree"])
        yield from (agree, first, samples)
        for name, doc in (
            ("audited", "live answers checked"),
            ("shadow", "shadow answers checked (a candidate configuration measured in idle time)"),
            ("dropped", "checks dropped from a full backlog"),
            ("failed", "checks that failed"),
        ):
            c = CounterMetricFamily(f"qcfuse_fidelity_{name}", doc)
            c.add_metric([], f[name])
            yield c
        waiting = GaugeMetricFamily("qcfuse_fidelity_waiting", "checks waiting for idle capacity")
        waiting.add_metric([], f["waiting"])
        yield waiting
        if f["target"] is not None:
            target = GaugeMetricFamily(
                "qcfuse_fidelity_target", "the answer-token agreement wanted (EngineConfig.fidelity)"
            )
            target.add_metric([], f["target"])
            yield target
