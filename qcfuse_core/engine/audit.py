"""The audit of live traffic: a sample of fused answers re-checked against full prefill, in idle time.

A fused request's answer is measured after it has been sent: one teacher-forced full-prefill
forward over its prompt and answer (eval/fidelity.py) says which of its tokens full prefill
would have chosen. That forward is background work at the scheduler's lowest priority
(`Scheduler.submit_idle`): it runs only in a step where no request waits or runs, so it
never adds to a live request's TTFT or ITL; a request arriving meanwhile waits for the one
check under way at most.

    sample      fused, greedy requests (temperature 0, no penalty, no grammar: a sampled
                answer has no single full-prefill counterpart). Every one until the model has
                `AuditConfig.warmup` samples, then one in round(1 / share).
    ledger      per model fingerprint, per configuration ("qcfuse@0.15": the method and
                ratio asked; the guard's escalations count in its agreement), per chunk-length
                band (the prompt's shortest chunk): requests, mean answer-token agreement,
                first-token agreement, whole answers identical. Kept in
                <cache dir>/fidelity/<fingerprint>.json (or `AuditConfig.directory`, or
                $QCFUSE_FIDELITY_DIR), written
                atomically after each check, so a restart keeps what was learned.
    target      `EngineConfig.fidelity`: the answer-token agreement the user wants. `choose`
                picks the cheapest candidate ratio whose audited mean agreement meets it over
                at least `min_samples` requests; until the evidence is there, the conservative
                one (CONSERVATIVE_RATIO); full prefill where every candidate is measured and
                none meets it. With a target the audit also measures the candidates that lack
                evidence: a sampled request is answered again, in idle time, at the candidate
                with the fewest samples, and that answer checked (shadow samples).

Read it with `engine.stats().fidelity`, `/metrics` (qcfuse_fidelity_*), `qcfuse fidelity`
and the studio's /api/fidelity.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qcfuse_core.engine.guard import first_token_margin, pick_threshold
from qcfuse_core.eval.fidelity import AnswerFidelity, measure
from qcfuse_core.paths import cache_dir
from qcfuse_core.selection import get_selector
from qcfuse_core.store.atomic import prepare_tmp, publish

if TYPE_CHECKING:
    from concurrent.futures import Future

    from qcfuse_core.engine.generation import GenerationConfig
    from qcfuse_core.model.adapter import ModelAdapter
    from qcfuse_core.types import FusionResult, Piece

log = logging.getLogger(__name__)

VERSION = 1
BANDS = ((80, "<=80"), (256, "81-256"), (1024, "257-1024"), (None, ">1024"))  # shortest chunk, tokens
CANDIDATE_RATIOS = (0.15, 0.3, 0.5)  # what the fidelity target chooses among, cheapest first
CONSERVATIVE_RATIO = 0.5  # the target's choice until the audit has evidence
# the recommended target (`qcfuse serve --fidelity` alone): the mean answer-token agreement a
# fixed ratio of 0.5 reaches, rounded up (SmolLM2-135M, hotpotqa_train 0-4: 0.968; a small
# sample - docs/benchmarks.md, "Fidelity")
DEFAULT_FIDELITY = 0.97
KEPT_VALUES = 1000  # per configuration: the most recent per-request agreements kept for intervals
Z95 = 1.96
GUARD_CATCH = 0.9  # the self-calibrated guard's catch rate of first-token divergences (calibrate-guard's default)


@dataclass(frozen=True)
class AuditConfig:
    """The audit's settings (module docstring).

    enabled: audit fused requests at all. share: the share of eligible requests audited
    once the model has `warmup` samples (every one before). min_samples: the requests a
    configuration needs before the fidelity target trusts its mean. max_backlog: checks
    waiting for idle time at most (a newer sample replaces the oldest). directory: where the
    ledgers are kept (None: <cache dir>/fidelity); persist=False keeps them in memory only."""

    enabled: bool = True
    share: float = 0.1
    warmup: int = 64
    min_samples: int = 32
    max_backlog: int = 64
    directory: str | None = None
    persist: bool = True

    def __post_init__(self) -> None:
        for name in ("enabled", "persist"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"audit {name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) or not 0 < self.share <= 1:
            raise ValueError(f"audit share must be in (0, 1], got {self.share!r}")
        for name in ("warmup", "min_samples", "max_backlog"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmup" else 1):
                raise ValueError(f"audit {name} must be a {'non-negative' if name == 'warmup' else 'positive'} int")


def check_fidelity(value: float | None) -> float | None:
    """A fidelity target: None (fixed ratio) or an answer-token agreement in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"fidelity must be an answer-token agreement in (0, 1] or None, got {value!r}")
    return float(value)


def band(lengths: Sequence[int]) -> str:
    """The chunk-length band of a prompt: its shortest chunk's (tokens)."""
    if not lengths:
        return "none"
    low = min(lengths)
    return next(name for top, name in BANDS if top is None or low <= top)


def config_label(method: str, ratio: float | None) -> str:
    """A configuration's name in the ledger: "qcfuse@0.15" (the method and ratio asked; the
    guard's escalations count in its agreement), "full"."""
    return method if ratio is None or method == "full" else f"{method}@{ratio:g}"


# ----------------------------------------------------------------------------- intervals
def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of k successes in n (95%)."""
    if n == 0:
        return None
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return round(max(0.0, mid - half), 4), round(min(1.0, mid + half), 4)


def bootstrap(values: Sequence[float], n_boot: int = 500, seed: int = 0) -> tuple[float, float] | None:
    """A 95% bootstrap interval of the mean of `values` (fixed seed: the same ledger gives the
    same interval)."""
    if not values:
        return None
    x = torch.tensor(values, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = x[torch.randint(len(x), (n_boot, len(x)), generator=g)].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return round(lo, 4), round(hi, 4)


# ----------------------------------------------------------------------------- the ledger
def _group() -> dict[str, Any]:
    return {"n": 0, "agree_sum": 0.0, "first": 0, "exact": 0, "tokens": 0, "values": []}


def _add(group: dict[str, Any], fid: AnswerFidelity, keep: bool) -> None:
    group["n"] += 1
    group["agree_sum"] += fid.agree
    group["first"] += int(fid.first_agree)
    group["exact"] += int(fid.prefix == fid.tokens)
    group["tokens"] += fid.tokens
    if keep:
        group["values"] = (group["values"] + [round(fid.agree, 4)])[-KEPT_VALUES:]


def _summary(group: dict[str, Any]) -> dict[str, Any]:
    n = group["n"]
    return {
        "n": n,
        "agree": round(group["agree_sum"] / n, 4) if n else None,
        "agree_ci": bootstrap(group["values"]) if group.get("values") else None,
        "first_agree": round(group["first"] / n, 4) if n else None,
        "first_agree_ci": wilson(group["first"], n),
        "exact": round(group["exact"] / n, 4) if n else None,
        "exact_ci": wilson(group["exact"], n),
    }


class Ledger:
    """One model's audit results (module docstring), persisted as JSON."""

    def __init__(self, fingerprint: str, model: str, path: Path | None) -> None:
        self.fingerprint, self.model, self.path = fingerprint, model, path
        self.samples = 0
        self.configs: dict[str, dict[str, Any]] = {}
        if path is not None and path.is_file():
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            if data.get("version") != VERSION or data.get("fingerprint") != self.fingerprint:
                raise ValueError("another version or model")
            self.samples, self.configs = int(data["samples"]), dict(data["configs"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("fidelity ledger %s is unreadable (%s); starting a new one", path, e)

    def add(self, label: str, band_name: str, fid: AnswerFidelity, shadow: bool, margin: float | None = None) -> None:
        entry = self.configs.setdefault(label, {"all": _group(), "bands": {}})
        if margin is not None:  # (the fused first-token margin, first token agreed): the guard's calibration
            entry["margins"] = (entry.get("margins", []) + [[round(margin, 6), int(fid.first_agree)]])[-KEPT_VALUES:]
        _add(entry["all"], fid, keep=True)
        _add(entry["bands"].setdefault(band_name, _group()), fid, keep=True)
        if not shadow:
            self.samples += 1

    def config(self, label: str) -> dict[str, Any]:
        entry = self.configs.get(label)
        return _summary(entry["all"]) if entry else _summary(_group())

    def to_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "model": self.model,
            "samples": self.samples,
            "configs": {
                label: {**_summary(e["all"]), "bands": {b: _summary(g) for b, g in sorted(e["bands"].items())}}
                for label, e in sorted(self.configs.items())
            },
        }

    def save(self) -> None:
        if self.path is None:
            return
        data = {"version": VERSION, "fingerprint": self.fingerprint, "model": self.model}
        data.update(samples=self.samples, configs=self.configs)
        blob = (json.dumps(data, indent=1) + "\n").encode()
        publish(prepare_tmp(self.path, [memoryview(blob)], sync=False), self.path, sync=False)


def ledger_dir(config: AuditConfig | None = None) -> Path:
    """Where the ledgers are kept: `AuditConfig.directory`, else $QCFUSE_FIDELITY_DIR, else
    <cache dir>/fidelity."""
    if config is not None and config.directory is not None:
        return Path(config.directory)
    return Path(os.environ.get("QCFUSE_FIDELITY_DIR") or cache_dir() / "fidelity")


def read_ledgers(directory: Path) -> list[dict[str, Any]]:
    """Every model's ledger in `directory` as `Ledger.to_dict()` (the `qcfuse fidelity` report)."""
    out = []
    for path in sorted(directory.glob("*.json")):
        fp = path.stem
        led = Ledger(fp, "", path)
        try:
            led.model = str(json.loads(path.read_text()).get("model", ""))
        except (OSError, ValueError):
            continue
        out.append(led.to_dict())
    return out


# ----------------------------------------------------------------------------- the target's choice
@dataclass(frozen=True)
class Choice:
    """The configuration the fidelity target picked for a request (`Audit.choose`)."""

    method: str
    ratio: float | None  # None: full prefill
    status: str  # measured | conservative | full | fixed (no target)
    reason: str

    @property
    def label(self) -> str:
        return config_label(self.method, self.ratio)


@dataclass
class Sample:
    """One audited answer: what the check needs, taken from the finished request."""

    prompt_ids: torch.Tensor
    answer: list[int]
    label: str
    band: str
    pieces: tuple[Piece, ...]
    method: str
    ratio: float | None
    generation: GenerationConfig
    margin: float | None = None  # the fused first-token margin the guard read (None: unknown)


def eligible(result: FusionResult, generation: GenerationConfig) -> bool:
    """A fused, greedy request with an answer: one the audit can compare with full prefill."""
    method = result.requested_method or result.method
    if method == "full" or not get_selector(method).fused or result.prompt_ids is None or not result.token_ids:
        return False
    g = generation
    return g.greedy and g.repetition_penalty == 1.0 and g.constraint is None


def sample_of(result: FusionResult, pieces: Sequence[Piece], generation: GenerationConfig) -> Sample:
    method = result.requested_method or result.method
    ratio = result.requested_ratio if result.requested_method is not None else result.ratio
    lengths = [s.end - s.start for s in result.spans if s.kind == "chunk"]
    assert result.prompt_ids is not None
    g = result.guard
    margin = g.value if g is not None and g.value is not None else None
    if margin is None and result.first_logits is not None and not (g is not None and g.rungs):
        margin = first_token_margin(result.first_logits)
    return Sample(
        result.prompt_ids, list(result.token_ids), config_label(method, ratio), band(lengths), tuple(pieces),
        method, ratio, generation, margin,
    )  # fmt: skip


Shadow = Callable[[Sequence["Piece"], str, float, "GenerationConfig"], "FusionResult"]


class Audit:
    """One engine's audit (module docstring). `finish` is called with every finished request
    (the scheduler's worker thread); the checks run as idle work (`submit_idle`); `stats`
    and `choose` may be called from any thread.

    adapter: the model; config: the engine's AuditConfig (read at each call); target: the
    engine's fidelity target; submit_idle: the scheduler's `submit_idle`; shadow: answers a
    request alone at another configuration (the engine's `Steps.run`, drained)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        config: Callable[[], AuditConfig],
        target: Callable[[], float | None],
        submit_idle: Callable[[Callable[[], object]], Future],
        shadow: Shadow | None = None,
    ) -> None:
        self._adapter, self._config, self._target = adapter, config, target
        self._submit_idle, self._shadow = submit_idle, shadow
        self._lock = threading.Lock()
        self._ledger: Ledger | None = None
        self._pending: deque[Future] = deque()
        self._seen = 0  # eligible requests
        self.counts = {"audited": 0, "shadow": 0, "dropped": 0, "failed": 0}
        self._summaries: dict[str, Any] = {}  # the ledger's summaries, until the next check

    @property
    def ledger(self) -> Ledger:
        with self._lock:
            if self._ledger is None:
                cfg, fp = self._config(), self._adapter.fingerprint()
                path = ledger_dir(cfg) / f"{fp}.json" if cfg.persist else None
                self._ledger = Ledger(fp, self._adapter.name, path)
            return self._ledger

    # ------------------------------------------------------------------ a finished request
    def finish(
        self, result: FusionResult, pieces: Sequence[Piece], generation: GenerationConfig, choice: Choice | None
    ) -> None:
        """Attach the configuration used and the deployment's measured fidelity to `result`
        (`FusionResult.fidelity`), and queue its check if it is sampled. Never raises: a
        failure here is logged, the request is answered all the same."""
        try:
            result.fidelity = self.report(result, choice)
            if self._config().enabled and eligible(result, generation) and self._sampled():
                sample = sample_of(result, pieces, generation)
                self._queue(lambda: self.check(sample))
        except Exception:
            log.exception("the fidelity audit could not take a request; it is answered all the same")

    def _sampled(self) -> bool:
        cfg, led = self._config(), self.ledger
        with self._lock:
            self._seen += 1
            if led.samples + len(self._pending) < cfg.warmup:
                return True
            return self._seen % max(1, round(1 / cfg.share)) == 0

    def _queue(self, work: Callable[[], object]) -> None:
        with self._lock:
            self._pending = deque(f for f in self._pending if not f.done())
            while len(self._pending) >= self._config().max_backlog:
                if self._pending.popleft().cancel():
                    self.counts["dropped"] += 1
            self._pending.append(self._submit_idle(work))

    # ------------------------------------------------------------------ the checks (idle work)
    def check(self, sample: Sample, shadow: bool = False) -> AnswerFidelity:
        """Measure one answer against full prefill and record it; with a target, then queue a
        shadow sample at the candidate with the least evidence."""
        try:
            fid = measure(self._adapter, sample.prompt_ids, sample.answer)
        except Exception:
            with self._lock:
                self.counts["failed"] += 1
            raise
        self.add(sample.label, sample.band, fid, shadow, sample.margin)
        if not shadow and self._target() is not None and self._shadow is not None:
            ratio = self._wanted(sample)
            if ratio is not None:
                self._queue(lambda: self.run_shadow(sample, ratio))
        return fid

    def add(
        self, label: str, band_name: str, fid: AnswerFidelity, shadow: bool = False, margin: float | None = None
    ) -> None:
        """Record one measured answer (`check`'s; a caller's own measurement too) and save the ledger."""
        led = self.ledger
        with self._lock:
            led.add(label, band_name, fid, shadow, margin)
            self.counts["shadow" if shadow else "audited"] += 1
        summary = led.to_dict()  # its intervals computed here, in idle time, not as requests finish
        with self._lock:
            self._summaries = {"ledger": summary}
        try:
            led.save()
        except OSError as e:
            log.warning("the fidelity ledger could not be written (%s); kept in memory", e)

    def _wanted(self, sample: Sample) -> float | None:
        """The candidate ratio with the fewest samples under `min_samples` (not the sample's own)."""
        need = self._config().min_samples
        led = self.ledger
        with self._lock:
            counts = [(led.config(config_label(sample.method, r))["n"], r) for r in CANDIDATE_RATIOS]
        short = [(n, r) for n, r in counts if n < need and r != sample.ratio]
        return min(short)[1] if short else None

    def run_shadow(self, sample: Sample, ratio: float) -> AnswerFidelity | None:
        """The sample's request answered again at `ratio` (in idle time) and that answer checked."""
        assert self._shadow is not None
        got = self._shadow(sample.pieces, sample.method, ratio, sample.generation)
        if got.prompt_ids is None or not got.token_ids:
            return None
        margin = got.guard.value if got.guard is not None else None
        again = Sample(got.prompt_ids, list(got.token_ids), config_label(sample.method, ratio), sample.band,
                       sample.pieces, sample.method, ratio, sample.generation, margin)  # fmt: skip
        return self.check(again, shadow=True)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued check has run (tests, `bench`); checks run only when idle."""
        while True:
            with self._lock:
                pending = [f for f in self._pending if not f.done()]
            if not pending:
                return
            pending[0].exception(timeout)

    # ------------------------------------------------------------------ what it knows
    def summary(self) -> dict[str, Any]:
        """The ledger's `to_dict()`: made by each check, in idle time (intervals are not free),
        and once when the ledger is first read."""
        led = self.ledger
        with self._lock:
            if "ledger" not in self._summaries:
                self._summaries["ledger"] = led.to_dict()
            return self._summaries["ledger"]

    def stats(self, method: str) -> dict[str, Any]:
        """What `engine.stats().fidelity` shows: the ledger, the audit's counters and settings,
        and the target with its choice now."""
        cfg, target = self._config(), self._target()
        with self._lock:
            waiting = sum(not f.done() for f in self._pending)
            counts = dict(self.counts, waiting=waiting, eligible=self._seen)
        out = {**self.summary(), **counts, "share": cfg.share, "warmup": cfg.warmup, "enabled": cfg.enabled}
        out["target"] = target
        if target is not None:
            c = self.choose(method)
            out["choice"] = {"config": c.label, "status": c.status, "reason": c.reason}
        return out

    def report(self, result: FusionResult, choice: Choice | None) -> dict[str, Any]:
        """`FusionResult.fidelity`: the configuration asked, how it was chosen, and what the
        audit has measured of it on this deployment (None before any sample)."""
        method = result.requested_method or result.method
        ratio = result.requested_ratio if result.requested_method is not None else result.ratio
        label = choice.label if choice is not None else config_label(method, ratio)
        measured = self.summary()["configs"].get(label)
        return {
            "target": self._target(),
            "config": label,
            "status": choice.status if choice is not None else "fixed",
            "reason": choice.reason if choice is not None else _fixed_reason(self._target()),
            "measured": None if measured is None else {k: measured[k] for k in ("n", "agree", "agree_ci")},
            "samples": self.summary()["samples"],
        }

    def choose(self, method: str, band_name: str | None = None) -> Choice:
        """The cheapest candidate configuration of `method` the audit shows meets the target
        (module docstring); the conservative one until there is evidence; full prefill when
        none does. band_name: the request's chunk-length band (`band`), known before its
        fused pass - where the audit has `min_samples` of that band at a ratio, the band's
        agreement decides for it instead of the configuration's over every band (short
        chunks lose more at a ratio than long ones)."""
        target, need = self._target(), self._config().min_samples
        assert target is not None
        configs = self.summary()["configs"]
        rows = []
        for r in CANDIDATE_RATIOS:
            s = configs.get(config_label(method, r), {"n": 0, "agree": None, "bands": {}})
            b = s.get("bands", {}).get(band_name) if band_name is not None else None
            rows.append((r, b if b is not None and b["n"] >= need else s, b is not None and b["n"] >= need))
        for r, s, by_band in rows:
            if s["n"] >= need and s["agree"] >= target:
                where = f" on chunks of {band_name} tokens" if by_band else ""
                why = f"measured agreement{where} {s['agree']:.3f} >= target {target:g} over {s['n']} requests"
                return Choice(method, r, "measured", why)
        plain = [(r, s) for r, s, _ in rows]
        cons = dict(plain)[CONSERVATIVE_RATIO]
        if cons["n"] >= need or all(s["n"] >= need for _, s in plain):
            why = f"no fused configuration meets target {target:g} (at {CONSERVATIVE_RATIO:g}: {cons['agree']:.3f})"
            return Choice("full", None, "full", why + ": full prefill")
        have = ", ".join(f"{r:g}: {s['n']}" for r, s in plain)
        why = f"not enough evidence yet (samples per ratio {have}; {need} needed): conservative {CONSERVATIVE_RATIO:g}"
        return Choice(method, CONSERVATIVE_RATIO, "conservative", why)

    # ------------------------------------------------------------------ the guard's self-calibration
    def guard_threshold(self, method: str, ratio: float) -> float | None:
        """For a model the guard has no calibration for: the threshold its audit samples at
        this configuration give - the smallest fused first-token margin that escalates at
        least GUARD_CATCH of the answers whose first token parted from full prefill's
        (`calibrate-guard`'s rule) - once `min_samples` of them hold a margin and at least
        one parted; None before."""
        need = self._config().min_samples
        led = self.ledger
        with self._lock:
            entry = led.configs.get(config_label(method, ratio), {})
            pairs = [(float(m), bool(a)) for m, a in entry.get("margins", [])]
        if len(pairs) < need or all(a for _, a in pairs):
            return None
        return pick_threshold(pairs, GUARD_CATCH)


def _fixed_reason(target: float | None) -> str:
    """Why a request ran at the ratio it asked: there is no target, or it named its own ratio."""
    if target is None:
        return "the ratio asked (no fidelity target)"
    return "the ratio asked (a request naming its ratio or method overrides the fidelity target)"
