"""Calibration of the adaptive budget: the attention-mass target whose mean recompute share on
a calibration split is each nominal ratio (`qcfuse calibrate-budget`)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qcfuse_core.eval.datasets import load_dataset
from qcfuse_core.eval.hooks import internals
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.selection.adaptive import calibration_dir, ranking_options
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.selection.scoring import AdaptiveBudget, adaptive_count
from qcfuse_core.selection.selectors import ranking_scores
from qcfuse_core.store import MemoryStore

log = logging.getLogger(__name__)

DEFAULT_SHARES = (0.1, 0.15, 0.2, 0.3)


def question_masses(engine, dataset: str, *, limit: int | None, offset: int = 0, options: dict | None = None):
    """Per question: (candidate scores (M,) fp32 host, context tokens, glue tokens). The
    scores are the ones a selection with these options ranks and counts by."""
    # what the adaptive budget counts on: the ranking's scores (the mass, weighted by the
    # profile's position prior where it has one), with the options an adaptive selection gets
    adaptive_opts = internals(engine).selection_options("adaptive", options or {})
    ranking = QCFuseOptions.from_options(dict(adaptive_opts, budget="adaptive"))  # refuses chunk_sinks
    fixed = dict(adaptive_opts, budget="fixed")
    out = []
    for ex in tqdm(load_dataset(dataset, limit=limit, offset=offset), desc="calibrate", unit="question", disable=None):
        engine = internals(engine).replace(store=MemoryStore())
        steps = internals(engine).steps
        prompt, _, _ = steps.fuse_pieces(engine.frame.rag_pieces(ex.question, list(ex.passages)))
        scored = steps.select(prompt, "qcfuse", 0.15, options=fixed).selection.scores
        assert scored is not None  # qcfuse scores every context token
        mass = torch.zeros(prompt.num_tokens)
        mass[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = scored.float().cpu()
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


def calibrate(
    engine,
    dataset: str,
    *,
    shares=DEFAULT_SHARES,
    limit: int | None = None,
    offset: int = 0,
    floor: float = 0.05,
    ceiling: float = 0.5,
    options: dict | None = None,
) -> dict:
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
    used = QCFuseOptions.from_options(internals(engine).selection_options("adaptive", options or {}))
    assert used.critical_layers is not None  # selection_options fills them in for a probing method
    return {
        "model": adapter.name,
        "fingerprints": [adapter.fingerprint()],
        "match": [],
        "critical_layers": list(used.critical_layers),
        "options": ranking_options(used),
        "floor": floor,
        "ceiling": ceiling,
        "n": len(masses),
        "targets": targets,
        "mean_share_at_target": achieved,
        "unreachable_shares": skipped,
        "source": f"qcfuse calibrate-budget --dataset {Path(dataset).name} --offset {offset} --limit {len(masses)}",
        "seconds": round(time.perf_counter() - t0, 1),
    }


def save_calibration(cal: dict, path: Path | None, adapter: ModelAdapter) -> Path:
    target = path or calibration_dir() / f"{adapter.fingerprint()}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(cal, indent=1) + "\n")
    return target
