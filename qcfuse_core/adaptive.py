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
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

import torch

from qcfuse_core.model import ModelAdapter, cache_dir
from qcfuse_core.scoring import AdaptiveBudget, adaptive_count
from qcfuse_core.selectors import QCFuseOptions, QCFuseSelector, SelectionContext, ranking_scores, register
from qcfuse_core.types import SelectionResult

log = logging.getLogger(__name__)

PACKAGED = "adaptive_budget.json"
DEFAULT_SHARES = (0.1, 0.15, 0.2, 0.3)


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
    raise ValueError(f"ratio {share:g} is outside the calibrated mean shares {[s for s, _ in pts]}; "
                     "run `qcfuse calibrate-budget --shares ...` to cover it")


@register
class AdaptiveSelector(QCFuseSelector):
    """qcfuse with the adaptive budget whose mean recompute share on the calibration split
    is `ratio` (the target mass comes from the model's calibration)."""

    name = "adaptive"

    def select(self, ctx: SelectionContext) -> SelectionResult:
        cal, source = lookup_calibration(ctx.adapter)
        if cal is None:
            raise ValueError(f"no adaptive-budget calibration for {ctx.adapter.name}; run `qcfuse calibrate-budget "
                             "--dataset CALIBRATION.json` first")
        check_calibrated_ranking(cal, QCFuseOptions.from_options(ctx.options))
        opts = dict(ctx.options, budget="adaptive", target_mass=target_for(cal, ctx.ratio),
                    floor=cal.get("floor", 0.05), ceiling=cal.get("ceiling", 0.5))
        sel = super().select(replace(ctx, options=opts))
        sel.method = self.name
        sel.details.update(target_mass=opts["target_mass"], calibration=source)
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
        raise ValueError(f"the adaptive budget of {cal.get('model', 'this model')} was calibrated at critical layers "
                         f"{layers}, this selection reads {list(opts.critical_layers)}; run `qcfuse calibrate-budget` "
                         "with these layers")
    want, have = cal.get("options", {}), ranking_options(opts)
    if {k: float(v) for k, v in want.items()} != {k: float(v) for k, v in have.items()}:
        raise ValueError(f"the adaptive budget of {cal.get('model', 'this model')} was calibrated with ranking options "
                         f"{want or 'none'}, this selection has {have or 'none'}; run `qcfuse calibrate-budget` with "
                         "these options")


# ----------------------------------------------------------------------------- calibration


def question_masses(engine, dataset: str, *, limit: int | None, offset: int = 0, options: dict | None = None):
    """Per question: (candidate scores (M,) fp32 host, context tokens, glue tokens). The
    scores are the ones a selection with these options ranks and counts by."""
    from tqdm import tqdm

    from qcfuse_core.datasets import load_dataset
    from qcfuse_core.store import MemoryStore

    # what the adaptive budget counts on: the ranking's scores (the mass, weighted by the
    # profile's position prior where it has one), with the options an adaptive selection gets
    adaptive_opts = engine.selection_options("adaptive", options or {})
    ranking = QCFuseOptions.from_options(dict(adaptive_opts, budget="adaptive"))  # refuses chunk_sinks
    fixed = dict(adaptive_opts, budget="fixed")
    out = []
    for ex in tqdm(load_dataset(dataset, limit=limit, offset=offset), desc="calibrate", unit="question", disable=None):
        engine.store = MemoryStore()
        prompt, _, _ = engine.fuse_pieces(engine.rag_pieces(ex.question, list(ex.passages)))
        sel = engine.select(prompt, "qcfuse", 0.15, options=fixed)
        mass = torch.zeros(prompt.num_tokens)
        mass[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = sel.selection.scores.float().cpu()
        cand = torch.nonzero(prompt.mask("chunk")).flatten()
        scores = ranking_scores(prompt, mass, ranking)
        out.append((scores[cand], prompt.context_tokens, int(prompt.mask("text").sum())))
        log.info("calibration question %s: %d context tokens", ex.id, prompt.context_tokens)
    return out


def mean_share(masses, target: float, floor: float, ceiling: float) -> float:
    """Mean recompute share over questions at `target` (as `bench quality` measures it)."""
    shares = []
    for scores, ctx_n, glue in masses:
        n = adaptive_count(scores, target, int(round(floor * ctx_n)), int(round(ceiling * ctx_n)))
        shares.append((n + glue) / max(1, ctx_n))
    return sum(shares) / len(shares)


def solve_target(masses, share: float, floor: float = 0.05, ceiling: float = 0.5, iters: int = 60) -> float:
    """The target mass in (0, 1] whose mean share is `share` (bisection; the mean rises with the target)."""
    lo, hi = 1e-6, 1.0
    if mean_share(masses, hi, floor, ceiling) < share - 1e-6 or mean_share(masses, lo, floor, ceiling) > share + 1e-6:
        raise ValueError(f"mean share {share:g} is out of reach with floor {floor:g} and ceiling {ceiling:g}")
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mean_share(masses, mid, floor, ceiling) < share:
            lo = mid
        else:
            hi = mid
    return hi


def calibrate(engine, dataset: str, *, shares=DEFAULT_SHARES, limit: int | None = None, offset: int = 0,
              floor: float = 0.05, ceiling: float = 0.5, options: dict | None = None) -> dict:
    """Calibrate target masses on `dataset` -> calibration dict (format of the packaged file)."""
    AdaptiveBudget(0.5, floor, ceiling)  # validates floor / ceiling
    t0 = time.perf_counter()
    masses = question_masses(engine, dataset, limit=limit, offset=offset, options=options)
    if not masses:
        raise ValueError(f"no questions in {dataset}")
    if not any(True for _ in shares):
        raise ValueError("no shares to calibrate")
    targets, achieved, skipped = {}, {}, []
    for s in shares:
        try:
            t = solve_target(masses, float(s), floor, ceiling)
        except ValueError as e:  # the other shares are still worth their questions' probes
            log.warning("%s; skipped", e)
            skipped.append(float(s))
            continue
        targets[f"{s:g}"] = round(t, 6)
        achieved[f"{s:g}"] = round(mean_share(masses, round(t, 6), floor, ceiling), 5)
    adapter = engine.adapter
    used = QCFuseOptions.from_options(engine.selection_options("adaptive", options or {}))
    return {
        "model": adapter.name, "fingerprints": [adapter.fingerprint()], "match": [],
        "critical_layers": list(used.critical_layers), "options": ranking_options(used),
        "floor": floor, "ceiling": ceiling, "n": len(masses),
        "targets": targets, "mean_share_at_target": achieved, "unreachable_shares": skipped,
        "source": f"qcfuse calibrate-budget --dataset {Path(dataset).name} --offset {offset} --limit {len(masses)}",
        "seconds": round(time.perf_counter() - t0, 1),
    }


def save_calibration(cal: dict, path: Path | None, adapter: ModelAdapter) -> Path:
    target = path or calibration_dir() / f"{adapter.fingerprint()}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(cal, indent=1) + "\n")
    return target
