"""Planner: exact load/recompute decisions on synthetic rates; rates JSON round trip."""

import pytest

from qcfuse_core.cache.planner import Rates, load_rates, plan, rates_path, save_rates

# 1 ms per token of prefill; 1 MB of KV per token; host 1000 GB/s (1 us/token), disk 2 GB/s (0.5 ms/token)
RATES = Rates(prefill_ms_per_token=1.0, tier_gbps={"host": 1000.0, "disk": 2.0}, kv_bytes_per_token=1_000_000)


def test_fast_tier_loads_everything():
    p = plan(RATES, [(100, "host")] * 4, ratio=0.1, total_tokens=410, fresh_rows=10, overlap=1.0)
    assert p.loaded == [0, 1, 2, 3] and p.recomputed == [] and not p.all_recompute
    assert p.est_load_ms == pytest.approx(0.4)
    assert p.est_compute_ms == pytest.approx(10 + 40)  # fresh rows + 10% of 400
    assert p.est_fused_ms == pytest.approx(50) and p.est_full_ms == pytest.approx(410)


def test_slow_chunks_move_to_recompute_slowest_first():
    # disk chunk: load 50 ms or recompute 90 more rows (90 ms); four disk chunks loaded: 200 ms
    chunks = [(100, "host"), (100, "disk"), (100, "disk"), (100, "disk"), (100, "disk")]
    p = plan(RATES, chunks, ratio=0.1, total_tokens=510, fresh_rows=10, overlap=1.0)
    # perfect overlap; all loaded: max(200.1, 60) -> one disk chunk recomputed: max(150.1, 150) -> two: max(100.1, 240) stop
    assert p.recomputed == [1] and p.loaded == [0, 2, 3, 4]
    assert p.est_fused_ms == pytest.approx(150.1)
    assert p.est_fused_ms < p.est_full_ms


def test_partial_overlap_charges_the_hidden_part():
    # the default half overlap: max(load, compute) + 0.5 x min(load, compute)
    p = plan(RATES, [(100, "host")] * 4, ratio=0.1, total_tokens=410, fresh_rows=10)
    assert p.est_fused_ms == pytest.approx(50 + 0.5 * 0.4)
    chunks = [(100, "host"), (100, "disk"), (100, "disk"), (100, "disk"), (100, "disk")]
    p = plan(RATES, chunks, ratio=0.1, total_tokens=510, fresh_rows=10)
    # all loaded: 200.1 + 30 = 230.1; one recomputed: 150.1 + 75 = 225.1; two: 240 + 50.05 stop
    assert p.recomputed == [1] and p.est_fused_ms == pytest.approx(225.1)
    with pytest.raises(ValueError, match="overlap"):
        plan(RATES, chunks, ratio=0.1, total_tokens=510, fresh_rows=10, overlap=1.5)


def test_h200_disk_tier_balanced_plan_is_refused():
    """The H200 disk case (2026-11-30, llama-3.1-8b shape, 10 x 1024 + 48 tokens): loading 3
    chunks and recomputing 7 was estimated at 0.70x full prefill under perfect overlap and
    ran at 1.10x; with half overlap the planner runs an ordinary prefill instead."""
    h200 = Rates(prefill_ms_per_token=0.0322, tier_gbps={"disk": 1.8}, kv_bytes_per_token=131072)
    args = dict(ratio=0.0, total_tokens=10 * 1024 + 48, fresh_rows=48, num_layers=32, overhead_ms=0.6)
    optimistic = plan(h200, [(1024, "disk")] * 10, overlap=1.0, **args)
    assert optimistic.loaded == [7, 8, 9] and not optimistic.all_recompute
    assert optimistic.est_fused_ms < 0.75 * optimistic.est_full_ms
    assert plan(h200, [(1024, "disk")] * 10, **args).all_recompute


def test_missing_cache_is_recomputed():
    p = plan(RATES, [(100, None), (100, "host")], ratio=0.2, total_tokens=210, fresh_rows=10)
    assert p.recomputed == [0] and p.loaded == [1]
    assert p.est_compute_ms == pytest.approx(10 + 100 + 20)


def test_never_slower_than_full():
    slow = Rates(prefill_ms_per_token=1.0, tier_gbps={"disk": 0.01}, kv_bytes_per_token=1_000_000)
    p = plan(slow, [(100, "disk")] * 3, ratio=0.3, total_tokens=310, fresh_rows=10, overhead_ms=50)
    assert p.all_recompute and p.recomputed == [0, 1, 2] and p.loaded == []
    assert p.est_fused_ms == p.est_full_ms == pytest.approx(310)


def test_full_layers_count_every_row():
    # cacheblend: 2 of 4 layers recompute everything: compute = 1 x (0.5 x 410 + 0.5 x rows)
    p = plan(RATES, [(100, "host")] * 4, ratio=0.1, total_tokens=410, fresh_rows=10, full_layers=2, num_layers=4)
    assert p.est_compute_ms == pytest.approx(0.5 * 410 + 0.5 * 50)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="no measured bandwidth for tier 'gpu'"):
        plan(RATES, [(10, "gpu")], ratio=0.1, total_tokens=20, fresh_rows=10)
    with pytest.raises(ValueError, match="ratio"):
        plan(RATES, [(10, "host")], ratio=1.5, total_tokens=20, fresh_rows=10)
    with pytest.raises(ValueError, match="prefill_ms_per_token"):
        Rates(prefill_ms_per_token=0, tier_gbps={}, kv_bytes_per_token=1)
    with pytest.raises(ValueError, match="bandwidth"):
        Rates(prefill_ms_per_token=1, tier_gbps={"disk": 0}, kv_bytes_per_token=1)


def test_rates_json_round_trip(tmp_path):
    path = rates_path(tmp_path, "0123456789abcdef", "NVIDIA H200")
    assert path.name == "rates-0123456789abcdef-NVIDIA_H200.json"
    assert load_rates(path) is None
    save_rates(RATES, path)
    assert load_rates(path) == RATES
