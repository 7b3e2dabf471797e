"""The engine over the tiered store: layer-wise streaming through the prefetcher and the
load-or-recompute planner give the same answers as in-memory fusion."""

from __future__ import annotations

import pytest

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.cache.planner import Rates
from qcfuse_core.store import kv_dir, open_store

DOCS = [
    "The Zephyr Institute is a marine research station in Port Halden. It was founded in 1987 by the marine biologist Ada Ferreira.",
    "Cape Wrayth lighthouse stands on the northern tip of Veloria. The stone tower is thirty-two metres tall and was first lit in 1884.",
    "Halden Rovers is the football club of Port Halden. It was founded in 1911 and plays at Quayside Park.",
]
Q = "How tall is the Cape Wrayth lighthouse?"


@pytest.fixture
def tiered(smol, tmp_path):
    eng = QCFuseEngine(smol, store=open_store(kv_dir(tmp_path)))
    for i, d in enumerate(DOCS):
        eng.build_chunks([d], [f"n{i}"])
    yield eng
    eng.caches.store.close()


@pytest.mark.parametrize("method", ["qcfuse", "cacheblend", "epic", "naive"])
def test_streamed_layers_answer_like_in_memory_fusion(smol, tiered, method):
    mem = QCFuseEngine(smol)
    a = mem.answer(Q, DOCS, method=method, ratio=0.3, max_new_tokens=12)
    b = tiered.answer(Q, DOCS, method=method, ratio=0.3, max_new_tokens=12)
    assert b.cache_hits == 3 and b.cache_misses == 0
    assert "load_wait_ms" in b.timings_ms
    assert b.token_ids == a.token_ids
    assert b.selection.rows.tolist() == a.selection.rows.tolist()


def _rates(gbps: float, overhead_ms: float = 0.0) -> Rates:
    return Rates(prefill_ms_per_token=1.0, tier_gbps={"gpu": gbps, "host": gbps, "disk": gbps},
                 kv_bytes_per_token=30 * 2 * 3 * 64 * 4, overhead_ms=overhead_ms)


def test_planner_runs_full_prefill_when_fusion_cannot_win(tiered):
    full = tiered.answer(Q, DOCS, method="full", max_new_tokens=8)
    tiered._steps.rates = _rates(1e-9)  # loading a chunk would take "forever": recompute them all, and
    # reusing only the exact prefix does not promise a clear win (planner margin): full prefill
    r = tiered.answer(Q, DOCS, method="qcfuse", max_new_tokens=8)
    assert r.plan["all_recompute"] and r.method == "full"
    assert r.token_ids == full.token_ids


def test_planner_loads_when_loading_is_cheap(tiered):
    tiered._steps.rates = _rates(1e6)
    r = tiered.answer(Q, DOCS, method="qcfuse", max_new_tokens=4)
    assert not r.plan["all_recompute"] and sorted(r.plan["loaded"]) == [0, 1, 2]
    assert r.method == "qcfuse" and r.recomputed_tokens < r.context_tokens
