"""The quality guard: a fused request whose answer may part from full prefill's gets more recompute.

A fused prefill recomputes a share of the context; most requests need little, a few need
much more (chunks too short for a 15% budget to cover their fact, a question whose evidence
the probe ranks low). After the fused prefill the guard reads one signal and acts on it:

    signal      first_token_margin: p1 - p2 of the fused first-token distribution (softmax of
                the prefill's last row). Free (the logits exist) and, measured on the dev
                sets, the candidate that best separated requests whose greedy first token
                differs from full prefill's (docs/benchmarks.md, "Quality guard"): the probe's
                uncovered mass, the recomputed rows' K/V deviation at the critical layers,
                chunk lengths and the selection's score margin separated them far worse.
    threshold   calibrated per model (`qcfuse calibrate-guard`): a user calibration
                <cache_dir>/guard/<fingerprint>.json, else the packaged table
                qcfuse_core/data/guard.json (by fingerprint, then by name), else the model's
                own audit samples once there are enough (engine/audit.py: the same rule over
                the live answers it checked), else nothing (the guard then only reports; logged).
    ladder      margin < threshold: the request is answered again at each ratio of
                `GuardConfig.ladder` in turn - a ratio below 1 fuses the prompt again with the
                probe's scores re-ranked at the larger budget (nothing probed or tokenized
                again; the request's KV buffer reused), 1.0 is full prefill (HF's own forward
                of the prompt's token ids: exactly a `full` request's answer) - reading the
                signal again after each and stopping at the first rung whose margin clears the
                threshold. A selection with no scores to re-rank (the adaptive budget's) skips
                to full prefill. The default ladder is full prefill alone: on the dev sets a
                0.5 rung first rarely cleared the threshold, so it spent its 0.5 and still went
                on to full prefill (docs/benchmarks.md, "Quality guard").
    ceiling     `GuardConfig.max_added_ms`: a rung whose estimated time (the fused prefill's
                time per recomputed row x the rung's rows) would take the added time past it
                is not run (reason `ceiling`).

The decision is a function of the logits and the threshold only, so a request repeated
with the same logits is escalated the same way (`EngineConfig.deterministic` makes the
logits themselves independent of what else runs). What the guard saw and did is the
request's `FusionResult.guard` (a `GuardReport`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qcfuse_core.paths import cache_dir
from qcfuse_core.selection import get_selector
from qcfuse_core.types import GUARD_SIGNAL, SelectionResult
from qcfuse_core.types import GuardReport as GuardReport

if TYPE_CHECKING:
    from qcfuse_core.engine.request import Prefilled, Request
    from qcfuse_core.model.adapter import ModelAdapter

log = logging.getLogger(__name__)

SIGNAL = GUARD_SIGNAL
PACKAGED = "guard.json"
GUARDED_LABEL = "qcfuse+guard"  # the guard's rows in `bench quality`


@dataclass(frozen=True)
class GuardConfig:
    """The quality guard's settings (module docstring). On by default.

    enabled: False turns it off for every request (a request's `guard=False` turns it off
    for that request alone). threshold: escalate when the fused first-token margin is below
    it (None: the model's calibration). ladder: the ratios tried in turn, increasing; 1.0
    is full prefill. max_added_ms: the most time escalation may add to one request's
    prefill (None: no ceiling)."""

    enabled: bool = True
    threshold: float | None = None
    ladder: tuple[float, ...] = (1.0,)
    max_added_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"guard enabled must be True or False, got {self.enabled!r}")
        if self.threshold is not None and not (
            isinstance(self.threshold, (int, float))
            and not isinstance(self.threshold, bool)
            and 0 <= self.threshold <= 1
        ):
            raise ValueError(f"guard threshold must be in [0, 1] or None, got {self.threshold!r}")
        ladder = tuple(float(r) for r in self.ladder)
        if not ladder or any(not 0 < r <= 1 for r in ladder) or list(ladder) != sorted(set(ladder)):
            raise ValueError(f"guard ladder must be increasing ratios in (0, 1], got {self.ladder!r}")
        object.__setattr__(self, "ladder", ladder)
        if self.max_added_ms is not None and not (
            isinstance(self.max_added_ms, (int, float)) and not isinstance(self.max_added_ms, bool)
        ):
            raise ValueError(f"guard max_added_ms must be a number or None, got {self.max_added_ms!r}")
        if self.max_added_ms is not None and self.max_added_ms < 0:
            raise ValueError(f"guard max_added_ms must be >= 0, got {self.max_added_ms!r}")


def first_token_margin(logits: torch.Tensor) -> float:
    """(vocab,) logits -> p1 - p2 of their softmax (fp32): how far the greedy first token is
    ahead of the runner-up."""
    top = torch.softmax(logits.detach().float(), -1).topk(2).values
    return float(top[0] - top[1])


def escalate(value: float, threshold: float) -> bool:
    """The guard's decision: a margin below the threshold escalates."""
    return value < threshold


def action_name(ratio: float) -> str:
    return "full" if ratio >= 1.0 else f"ratio {ratio:g}"


# ----------------------------------------------------------------------------- the decision
@dataclass(frozen=True)
class Keep:
    """Decode from the prefill just decided on."""


@dataclass(frozen=True)
class Refuse:
    """Prefill the request again at `ratio` (1.0: full prefill), with `selection`'s rows below
    1.0 (the probe's scores re-ranked at that ratio: nothing probed again)."""

    ratio: float
    selection: SelectionResult | None = None


KEEP = Keep()
Rechoose = Callable[[float], SelectionResult | None]  # a ratio -> the request's rows re-ranked at it, or None


class Guard:
    """The quality guard of one engine: its config and its model's threshold (resolved once).

    `decide` is called once per finished prefill of a request: after its own pass, and after
    each rung the guard asked for (rung: that rung's ratio); it keeps the request's
    `GuardReport` and answers Keep or Refuse(next rung)."""

    def __init__(self, config: Callable[[], GuardConfig], adapter: ModelAdapter) -> None:
        self._config, self._adapter = config, adapter
        self._resolved: tuple[float | None, str] | None = None
        # for a model calibrated nowhere: (method, ratio) -> the threshold its audit samples give,
        # or None while they are too few (engine/audit.py `Audit.guard_threshold`)
        self.self_calibration: Callable[[str, float], float | None] | None = None

    def threshold(self) -> tuple[float | None, str]:
        """The threshold and where it came from: the config's, else the model's calibration."""
        cfg = self._config()
        if cfg.threshold is not None:
            return float(cfg.threshold), "GuardConfig.threshold"
        if self._resolved is None:
            self._resolved = resolve_threshold(self._adapter.fingerprint(), self._adapter.name)
        return self._resolved

    def decide(
        self, req: Request, pre: Prefilled, fuse_ms: float, rechoose: Rechoose, rung: float | None = None
    ) -> Keep | Refuse:
        """Keep `pre`, or Refuse it for the next rung of the ladder. fuse_ms: the time of the
        prefill decided on (the ceiling's estimate scales the first pass's time by rows)."""
        if rung is not None:
            return self._after_rung(req, pre, fuse_ms, rechoose, rung)
        rep = req.guard_report = GuardReport(spent_tokens=pre.recomputed_tokens)
        cfg = self._config()
        if not get_selector(req.method).guarded:
            rep.code = "not_guarded"
            rep.reason = (
                "full prefill: nothing fused to guard"
                if req.method == "full"
                else f"method {req.method} is not guarded"
            )
            return KEEP
        if not cfg.enabled or not req.guard:
            rep.reason = "turned off " + ("in EngineConfig.guard" if not cfg.enabled else "for this request")
            return KEEP
        threshold, rep.source = self.threshold()
        if threshold is None and self.self_calibration is not None:
            threshold = self.self_calibration(req.method, req.ratio)
            if threshold is not None:
                rep.source = "self-calibration from this deployment's audit (engine/audit.py)"
        if threshold is None:
            rep.code, rep.reason = "uncalibrated", "no calibration for this model: run `qcfuse calibrate-guard`"
            return KEEP
        rep.threshold = threshold
        rep.value = value = first_token_margin(pre.logits[-1])
        rep.action = "kept"
        if not escalate(value, threshold):
            rep.code, rep.reason = "margin_ok", "margin at or above the threshold"
            return KEEP
        rep.code, rep.reason = "low_margin", "margin below the threshold"
        req.guard_row_ms = fuse_ms / max(1, int(pre.selection.rows.numel()))
        return self._next_rung(req, pre, rechoose, after=0.0)

    def _after_rung(
        self, req: Request, pre: Prefilled, fuse_ms: float, rechoose: Rechoose, rung: float
    ) -> Keep | Refuse:
        rep = req.guard_report
        assert rep is not None and rep.threshold is not None
        rep.added_ms += fuse_ms
        rep.spent_tokens += pre.recomputed_tokens
        value = first_token_margin(pre.logits[-1])
        rep.rungs.append((rung, value))
        rep.action = action_name(rung)
        if rung >= 1.0 or not escalate(value, rep.threshold):
            return KEEP
        return self._next_rung(req, pre, rechoose, after=rung)

    def _next_rung(self, req: Request, pre: Prefilled, rechoose: Rechoose, after: float) -> Keep | Refuse:
        """The first rung of the ladder above `after` (and above the request's own ratio) that
        the time ceiling allows and that has rows to run; Keep when none is left."""
        cfg, rep, prompt = self._config(), req.guard_report, pre.prompt
        assert rep is not None
        uncached = int(prompt.uncached_mask().sum())
        for ratio in cfg.ladder:
            if ratio <= after or (ratio < 1.0 and ratio <= req.ratio):
                continue
            rows = prompt.num_tokens if ratio >= 1.0 else uncached + round(ratio * prompt.context_tokens)
            if cfg.max_added_ms is not None and rep.added_ms + req.guard_row_ms * rows > cfg.max_added_ms:
                rep.code = "ceiling"
                rep.reason += f"; {action_name(ratio)} would pass the ceiling of {cfg.max_added_ms:g} ms"
                continue
            if ratio >= 1.0:
                return Refuse(1.0)
            sel = rechoose(ratio)
            if sel is not None:  # else nothing to re-rank (an adaptive budget): on to the next rung
                return Refuse(ratio, sel)
        return KEEP


# ----------------------------------------------------------------------------- thresholds
def guard_dir() -> Path:
    return cache_dir() / "guard"


def packaged_table() -> dict:
    return json.loads(resources.files("qcfuse_core.data").joinpath(PACKAGED).read_text())


def resolve_threshold(fingerprint: str, name: str) -> tuple[float | None, str]:
    """-> (threshold, where it came from) for a model: a user calibration, else the packaged
    table by fingerprint, then by name; (None, ...) for a model calibrated nowhere - a margin
    threshold does not carry over from one model to another, so the guard leaves such a
    model's requests as fused and says so (logged once per engine)."""
    user = guard_dir() / f"{fingerprint}.json"
    if user.is_file():
        return _checked(json.loads(user.read_text()), str(user)), f"calibration {user}"
    table = packaged_table()
    for p in table["profiles"]:
        if fingerprint in p.get("fingerprints", []):
            return _checked(p, PACKAGED), f"packaged calibration {p['model']} (fingerprint)"
    low = name.lower()
    for p in table["profiles"]:
        if any(m.lower() in low for m in p.get("match", [])):
            return _checked(p, PACKAGED), f"packaged calibration {p['model']} (name)"
    log.warning(
        "no quality-guard calibration for %s (%s): the guard leaves its requests as fused - run `qcfuse calibrate-guard`",
        name,
        fingerprint,
    )
    return None, "uncalibrated"


def _checked(entry: dict, where: str) -> float:
    if entry.get("signal", SIGNAL) != SIGNAL:
        raise ValueError(f"{where}: signal {entry.get('signal')!r} is not {SIGNAL!r}")
    t = entry.get("threshold")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 1:
        raise ValueError(f"{where}: threshold must be a number in [0, 1], got {t!r}")
    return float(t)


def save_calibration(cal: dict, path: Path | None, fingerprint: str) -> Path:
    _checked(cal, "calibration")
    target = path or guard_dir() / f"{fingerprint}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(cal, indent=1) + "\n")
    return target


def pick_threshold(margins: list[tuple[float, bool]], catch: float) -> float:
    """The smallest threshold escalating (margin < threshold) at least `catch` of the
    disagreeing questions; 0.0 (never escalate) when none disagrees."""
    if not 0 < catch <= 1:
        raise ValueError(f"catch must be in (0, 1], got {catch!r}")
    bad = sorted(m for m, agree in margins if not agree)
    if not bad:
        return 0.0
    k = math.ceil(catch * len(bad))  # the k smallest margins must fall below the threshold
    above = [m for m, _ in margins if m > bad[k - 1]]
    # halfway to the next margin above the k-th: escalates the same questions, with slack
    nxt = min(above) if above else bad[k - 1] + 1e-6
    return min(1.0, round(0.5 * (bad[k - 1] + nxt), 6))
