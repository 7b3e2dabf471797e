"""Adaptive budget at a calibrated mean share: the `adaptive` method and its calibration.

qcfuse's adaptive budget (`QCFuseOptions(budget="adaptive")`) recomputes, per request, the
fewest top chunk tokens whose share of the probed mass reaches `target_mass` (clamped to
[floor, ceiling] x context): a question whose attention is spread out gets more recompute,
a focused one less. A target mass says nothing about the cost, so it is calibrated: on a
calibration split, the target whose **mean** recompute share equals a ratio r. Then

    method "adaptive", ratio r  =  qcfuse with budget adaptive, target_mass = calibrated(r)

costs r on average, like qcfuse at the fixed ratio r, and can be compared with it at the
same mean share. Ratios between calibrated points interpolate the target linearly; outside
them the method refuses (calibrate more shares).

Calibration (`qcfuse calibrate-budget --dataset musique_train.json`): per question one
probe (the shipped anchors and critical layers) gives the probed mass of every chunk token;
the recompute share at a target t is (adaptive count(t) + glue tokens) / context tokens, as
`bench quality` measures it; the mean over questions rises with t, so bisection finds each
share's target. No fused prefill runs: calibrating costs the chunk caches and one probe per
question.

Where targets come from, first match wins: a user calibration
`<cache_dir>/adaptive_budget/<fingerprint>.json` (written by the command), then the packaged
`qcfuse_core/data/adaptive_budget.json` by fingerprint, then by model name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from importlib import resources
from pathlib import Path

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.paths import cache_dir
from qcfuse_core.selection.base import SelectionContext, register
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.selection.probe import ProbeResult
from qcfuse_core.selection.selectors import ProbeRequest, QCFuseSelector
from qcfuse_core.types import SelectionResult

log = logging.getLogger(__name__)

PACKAGED = "adaptive_budget.json"


def calibration_dir() -> Path:
    return cache_dir() / "adaptive_budget"


def _packaged() -> list[dict]:
    return json.loads(resources.files("qcfuse_core.data").joinpath(PACKAGED).read_text())["profiles"]


def lookup_calibration(adapter: ModelAdapter) -> tuple[dict | None, str]:
    """-> (calibration dict or None, where it came from)."""
    fp = adapter.fingerprint()
    user = calibration_dir() / f"{fp}.json"
    if user.is_file():
        return json.loads(user.read_text()), f"calibration {user}"
    profiles = _packaged()
    for p in profiles:
        if fp in p.get("fingerprints", []):
            return p, f"packaged calibration {p['model']} (fingerprint)"
    name = adapter.name.lower()
    for p in profiles:
        if any(m.lower() in name for m in p.get("match", [])):
            return p, f"packaged calibration {p['model']} (name)"
    return None, "none"


def target_for(calibration: dict, share: float) -> float:
    """Calibrated target mass for a mean recompute share (linear between calibrated shares)."""
    pts = sorted((float(s), float(t)) for s, t in calibration["targets"].items())
    for s, t in pts:
        if abs(s - share) < 1e-9:
            return t
    for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
        if s0 < share < s1:
            return t0 + (t1 - t0) * (share - s0) / (s1 - s0)
    raise ValueError(
        f"ratio {share:g} is outside the calibrated mean shares {[s for s, _ in pts]}; "
        "run `qcfuse calibrate-budget --shares ...` to cover it"
    )


@register
class AdaptiveSelector(QCFuseSelector):
    """qcfuse with the adaptive budget whose mean recompute share on the calibration split
    is `ratio` (the target mass comes from the model's calibration)."""

    name = "adaptive"
    adaptive_budget = True

    def probe_request(self, ctx: SelectionContext) -> ProbeRequest:
        cal, source = lookup_calibration(ctx.adapter)
        if cal is None:
            raise ValueError(
                f"no adaptive-budget calibration for {ctx.adapter.name}; run `qcfuse calibrate-budget "
                "--dataset CALIBRATION.json` first"
            )
        check_calibrated_ranking(cal, QCFuseOptions.from_options(ctx.options))
        opts = dict(
            ctx.options,
            budget="adaptive",
            target_mass=target_for(cal, ctx.ratio),
            floor=cal.get("floor", 0.05),
            ceiling=cal.get("ceiling", 0.5),
        )
        req = super().probe_request(replace(ctx, options=opts))
        req.extra.update(target_mass=opts["target_mass"], calibration=source)
        return req

    def from_probe(self, req: ProbeRequest, probe: ProbeResult) -> SelectionResult:
        sel = super().from_probe(req, probe)
        sel.method = self.name
        sel.details.update(req.extra)
        return sel


# options that change the scores the adaptive count adds up (a target mass calibrated on one
# ranking gives another mean share on another)
RANKING_OPTIONS = ("position_prior", "prior_depth", "spread")


def ranking_options(opts: QCFuseOptions) -> dict:
    """The ranking options of `opts` that are set (not at their defaults)."""
    return {k: getattr(opts, k) for k in RANKING_OPTIONS if getattr(opts, k)}


def check_calibrated_ranking(cal: dict, opts: QCFuseOptions) -> None:
    """Refuses a selection whose ranking differs from the calibration's: the same critical
    layers (where both name them) and the same ranking options, else the target mass would
    not give the calibrated mean share."""
    layers = cal.get("critical_layers")
    if layers and opts.critical_layers is not None and sorted(layers) != sorted(opts.critical_layers):
        raise ValueError(
            f"the adaptive budget of {cal.get('model', 'this model')} was calibrated at critical layers "
            f"{layers}, this selection reads {list(opts.critical_layers)}; run `qcfuse calibrate-budget` "
            "with these layers"
        )
    want, have = cal.get("options", {}), ranking_options(opts)
    if {k: float(v) for k, v in want.items()} != {k: float(v) for k, v in have.items()}:
        raise ValueError(
            f"the adaptive budget of {cal.get('model', 'this model')} was calibrated with ranking options "
            f"{want or 'none'}, this selection has {have or 'none'}; run `qcfuse calibrate-budget` with "
            "these options"
        )


# ----------------------------------------------------------------------------- calibration
