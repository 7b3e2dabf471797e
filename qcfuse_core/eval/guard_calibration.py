"""Calibration of the quality guard's threshold (`qcfuse calibrate-guard`).

Per question of a calibration split: full prefill's greedy first token, and the fused first
token and its margin (`engine/guard.py`, p1 - p2) at the guarded ratio - computed here, or
read from `bench quality` records of a run that has them (`margins_from_records`). The threshold is
the smallest margin that escalates at least `catch` of the questions whose fused first token
differs from full prefill's (escalation: margin < threshold); the escalation rate it costs
on the split is reported beside it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qcfuse_core.engine.guard import SIGNAL, first_token_margin, pick_threshold
from qcfuse_core.engine.request import Planned
from qcfuse_core.eval.datasets import load_dataset
from qcfuse_core.eval.hooks import internals
from qcfuse_core.store import MemoryStore

log = logging.getLogger(__name__)


def question_margins(
    engine, dataset: str, *, ratio: float = 0.15, limit: int | None = None, offset: int = 0, method: str = "qcfuse"
) -> list[tuple[float, bool]]:
    """Per question: (fused first-token margin at `ratio`, whether its greedy first token is
    full prefill's)."""
    out = []
    for ex in tqdm(load_dataset(dataset, limit=limit, offset=offset), desc="calibrate-guard", disable=None):
        eng = internals(engine).replace(store=MemoryStore())
        steps = internals(eng).steps
        looked = steps.lookup(eng.frame.rag_pieces(ex.question, list(ex.passages)), "naive", streaming=False)
        loading = steps.start_loading(looked, Planned("naive", frozenset()))
        full = steps.fuse(loading, steps.select(loading.prompt, "full", 1.0), "full").logits[-1]
        fused = steps.fuse(loading, steps.select(loading.prompt, method, ratio), method).logits[-1]
        out.append((first_token_margin(fused), int(torch.argmax(fused)) == int(torch.argmax(full))))
        log.info("guard calibration %s: margin %.4f, agrees %s", ex.id, out[-1][0], out[-1][1])
    return out


def margins_from_records(records: list[dict], ratio: float = 0.15, method: str = "qcfuse") -> list[tuple[float, bool]]:
    """(margin, agrees) per question from `bench quality` records of `method` at `ratio`
    (their `first_margin` and `first_agree`), in record order."""
    return [
        (float(r["first_margin"]), bool(r["first_agree"]))
        for r in records
        if r.get("method") == method and r.get("ratio") == ratio and "first_margin" in r and r.get("variant") is None
    ]


def rates(margins: list[tuple[float, bool]], threshold: float) -> dict:
    """Catch rate (escalated share of the disagreeing) and escalation rate at `threshold`."""
    bad = [m for m, agree in margins if not agree]
    return {
        "n": len(margins),
        "disagree": len(bad),
        "catch_rate": round(sum(m < threshold for m in bad) / len(bad), 4) if bad else None,
        "escalation_rate": round(sum(m < threshold for m, _ in margins) / len(margins), 4) if margins else None,
    }


def calibrate(
    engine,
    dataset: str,
    *,
    catch: float = 0.9,
    ratio: float = 0.15,
    limit: int | None = None,
    offset: int = 0,
) -> dict:
    """-> the calibration dict (the packaged table's entry format)."""
    t0 = time.perf_counter()
    margins = question_margins(engine, dataset, ratio=ratio, limit=limit, offset=offset)
    if not margins:
        raise ValueError(f"no questions in {dataset}")
    source = f"qcfuse calibrate-guard --dataset {Path(dataset).name} --offset {offset} --limit {len(margins)}"
    return entry(engine.adapter, margins, catch, ratio, source, time.perf_counter() - t0)


def entry(adapter, margins: list[tuple[float, bool]], catch: float, ratio: float, source: str, seconds: float) -> dict:
    """The calibration dict of `margins` for `adapter`'s model."""
    if not margins:
        raise ValueError("no questions to calibrate on")
    threshold = pick_threshold(margins, catch)
    return {
        "model": adapter.name,
        "fingerprints": [adapter.fingerprint()],
        "match": [],
        "signal": SIGNAL,
        "threshold": threshold,
        "ratio": ratio,
        "catch_target": catch,
        **rates(margins, threshold),
        "source": f"{source} --catch {catch:g} --ratio {ratio:g}",
        "seconds": round(seconds, 1),
    }
