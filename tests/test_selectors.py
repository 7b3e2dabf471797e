"""Selection: exact picks on toy tensors, each method's invariants on a tiny random model.

Layout of the toy prompt (tests/qc_fixtures.py):
    [prefix 0..5][chunk 6..25][glue 26..27][chunk 28..51][chunk 52..67][suffix 68..74]
"""

import pytest
import torch

from qcfuse_core.selection import profiles as critical_layers
from qcfuse_core.selection.scoring import adaptive_count, covered_share, top_budget
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.selection.selectors import QueryAwareSelector
from qcfuse_core.selection.base import SelectionContext, get_selector
from qcfuse_core.model.testing import tiny_model
from tests.qc_fixtures import prompt_alone

PREFIX = range(0, 6)
GLUE = [26, 27]
SUFFIX = list(range(68, 75))
CHUNK = torch.tensor(list(range(6, 26)) + list(range(28, 68)))


@pytest.fixture(scope="module")
def setup():
    m = tiny_model("llama")
    return m, prompt_alone(m)


def test_top_budget_exact_with_stable_ties():
    pos = torch.tensor([10, 11, 12, 13, 14, 15])
    s = torch.tensor([0.1, 0.5, 0.5, 0.2, 0.9, 0.0])
    assert top_budget(pos, s, 3).tolist() == [11, 12, 14]
    assert top_budget(pos, s, 2).tolist() == [11, 14]  # tie 11/12 -> the earlier
    assert top_budget(pos, s, 0).tolist() == []
    assert top_budget(pos, s, 99).tolist() == pos.tolist()


def test_adaptive_count_covers_the_target_within_floor_and_ceiling():
    s = torch.tensor([1.0, 4.0, 2.0, 3.0])  # sorted 4,3,2,1 -> cumulative 0.4, 0.7, 0.9, 1.0
    assert adaptive_count(s, 0.7, 0, 4) == 2
    assert adaptive_count(s, 0.71, 0, 4) == 3
    assert adaptive_count(s, 0.4, 3, 4) == 3  # floor
    assert adaptive_count(s, 1.0, 0, 2) == 2  # ceiling
    assert adaptive_count(torch.zeros(4), 0.5, 1, 4) == 1
    assert covered_share(s, torch.tensor([False, True, False, True])) == pytest.approx(0.7)


def _check_rules(prompt, rows):
    rows = set(rows.tolist())
    assert not rows & set(PREFIX), "the prefix is never recomputed"
    assert set(SUFFIX) <= rows and set(GLUE) <= rows, "suffix and glue are always recomputed"


def test_choose_ranks_chunk_tokens_only(setup):
    m, prompt = setup
    mass = torch.zeros(prompt.num_tokens)
    mass[0] = 10.0  # prefix: never
    mass[27] = 9.0  # glue: always anyway, never counted in the budget
    mass[torch.tensor([40, 7, 60, 8])] = torch.tensor([5.0, 4.0, 3.0, 3.0])
    ctx = SelectionContext(m, prompt, 4 / 62)  # budget round(4/62 * 62 context tokens) = 4
    sel = get_selector("qcfuse").choose(ctx, QCFuseOptions(), mass, {})
    assert sel.rows.tolist() == [7, 8, 26, 27, 40, 60] + SUFFIX
    assert sel.details["positions"].tolist() == [7, 8, 40, 60]
    assert sel.scores.shape == (62,)  # chunks + glue


def test_choose_adaptive_budget(setup):
    m, prompt = setup
    mass = torch.zeros(prompt.num_tokens)
    mass[CHUNK] = 0.001
    mass[torch.tensor([30, 31, 32])] = 1.0
    ctx = SelectionContext(m, prompt, 0.3)
    opts = QCFuseOptions(budget="adaptive", target_mass=0.9, floor=0.0, ceiling=0.5)
    sel = get_selector("qcfuse").choose(ctx, opts, mass, {})
    assert sel.details["positions"].tolist() == [30, 31, 32]
    assert sel.details["mass_covered"] > 0.9
    opts = QCFuseOptions(budget="adaptive", target_mass=0.9, floor=0.1, ceiling=0.5)  # floor: 6 tokens
    assert get_selector("qcfuse").choose(ctx, opts, mass, {}).details["budget"] == 6


def test_qcfuse_selection_invariants_and_details(setup):
    m, prompt = setup
    ctx = SelectionContext(m, prompt, 0.25, options={"critical_layers": [1, 2]})
    sel = get_selector("qcfuse").select(ctx)
    _check_rules(prompt, sel.rows)
    assert sel.details["positions"].numel() == ctx.budget == 16
    assert sel.rows.numel() == 16 + len(GLUE) + len(SUFFIX)
    d = sel.details
    assert d["critical_layers"] == [1, 2] and d["anchor_method"] == "keynorm"
    assert d["anchors_per_layer"] == 3 * 4 + (3 + 3 + 2)  # sinks + ceil(0.125 x 20, 24, 16)
    assert len(d["probe_layer_ms"]) == 3
    assert torch.equal(get_selector("qcfuse").select(ctx).rows, sel.rows)  # deterministic
    chunk = prompt.segments[1].chunk
    assert chunk.anchors["keynorm"].shape == (3, 4 + 3)  # stored for the store's sidecar


def test_qcfuse_with_every_token_as_anchor_equals_the_full_context_probe(setup):
    m, prompt = setup
    last = m.num_layers - 1
    full = get_selector("qclast").select(SelectionContext(m, prompt, 0.3))
    opts = {"critical_layers": [last], "anchor_share": 1.0, "anchor_method": "keynorm"}
    for seg in prompt.segments:
        if seg.chunk is not None:
            seg.chunk.anchors.clear()
    every = get_selector("qcfuse").select(SelectionContext(m, prompt, 0.3, options=opts))
    assert torch.equal(every.rows, full.rows)
    assert torch.allclose(every.scores, full.scores, atol=1e-6)
    for seg in prompt.segments:
        if seg.chunk is not None:
            seg.chunk.anchors.clear()


def test_query_rows_scores_the_last_suffix_rows(setup):
    """query_rows=R ranks by the mass of the suffix's last R rows (pinned against the probe +
    query_mass by hand); R >= the suffix length is every row; bad values raise."""
    from qcfuse_core.selection.probe import context_keys, gather_context, query_mass, run_probe

    m, prompt = setup
    last = m.num_layers - 1
    seg, start = prompt.segments[-1], prompt.starts[-1]
    probe = run_probe(m, seg.token_ids, torch.arange(start, start + len(seg)),
                      gather_context(prompt, last + 1, None), keep=[last])
    k_ctx, pos = context_keys(m, prompt, last)
    ctx_pos = torch.nonzero(prompt.mask("chunk", "text")).flatten()
    for R in (1, 2):
        sel = get_selector("qclast").select(SelectionContext(m, prompt, 0.3, options={"query_rows": R}))
        mass = torch.zeros(prompt.num_tokens)
        mass[pos] = query_mass(probe.q[last], k_ctx, probe.k[last], m.scale, last=R)
        assert torch.allclose(sel.scores, mass[ctx_pos], atol=1e-7)
        assert sel.details["query_rows"] == R
        _check_rules(prompt, sel.rows)
    every = get_selector("qclast").select(SelectionContext(m, prompt, 0.3, options={"query_rows": 0}))
    assert not torch.equal(sel.scores, every.scores)
    same = get_selector("qclast").select(SelectionContext(m, prompt, 0.3, options={"query_rows": len(SUFFIX)}))
    assert torch.equal(same.scores, every.scores) and torch.equal(same.rows, every.rows)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="query_rows"):
            QCFuseOptions(query_rows=bad)


def test_deviation_pool_reranks_the_pool_by_mass_times_layer1_deviation(setup):
    """deviation_pool=k: layers 0-1 run for the top k x budget by mass; after layer 1 the budget
    keeps the largest mass x V deviation - pinned against a by-hand reference, and the
    deviation of each pool token equals CacheBlend's (which recomputes layers 0-1 for all)."""
    from qcfuse_core.model.fusion import fused_prefill
    from qcfuse_core.selection.scoring import top_budget

    m, prompt = setup
    ctx = SelectionContext(m, prompt, 0.25, options={"critical_layers": [1, 2], "deviation_pool": 2})
    sel = get_selector("qcfuse").select(ctx)
    n = ctx.budget  # 16 of 62 chunk tokens (see test_qcfuse_selection_invariants_and_details)
    plain = get_selector("qcfuse").select(SelectionContext(m, prompt, 0.25, options={"critical_layers": [1, 2]}))
    mass = torch.zeros(prompt.num_tokens)
    ctx_pos = torch.nonzero(prompt.mask("chunk", "text")).flatten()
    mass[ctx_pos] = plain.scores
    assert torch.equal(sel.scores, plain.scores)
    pool = top_budget(CHUNK, mass[CHUNK], 2 * n)
    assert torch.equal(sel.details["pool"], pool) and sel.full_layers == 0
    assert set(sel.rows.tolist()) == set(pool.tolist()) | set(GLUE) | set(SUFFIX)  # layers 0-1: the pool
    # reference: layer-1 V deviation of every token from CacheBlend's full layers 0-1
    seen = {}

    def grab(state):
        if state.layer == 1:
            seen["dev"] = (state.v_fresh - state.v_cached[state.rows]).pow(2).sum(dim=(1, 2))
            seen["rows"] = state.rows.clone()
        return None

    fused_prefill(m, prompt, torch.arange(prompt.num_tokens)[6:], full_layers=2, on_layer_end=grab)
    dev_all = torch.zeros(prompt.num_tokens)
    dev_all[seen["rows"]] = seen["dev"]
    want = top_budget(pool, mass[pool] * dev_all[pool], n)
    out = fused_prefill(m, prompt, sel.rows, full_layers=sel.full_layers, on_layer_end=sel.on_layer_end)
    assert torch.equal(sel.details["positions"], want)
    assert set(out.rows.tolist()) == set(want.tolist()) | set(GLUE) | set(SUFFIX)
    assert torch.equal(out.rows, sel.rows) and _check_rules(prompt, out.rows) is None
    assert torch.allclose(sel.details["deviation"], dev_all[want], rtol=1e-4, atol=1e-7)
    assert not torch.equal(want, plain.details["positions"])  # the re-ranking changed the pick
    for bad in (0.5, -1, True):
        with pytest.raises(ValueError, match="deviation_pool"):
            QCFuseOptions(deviation_pool=bad)
    with pytest.raises(ValueError, match="fixed"):
        QCFuseOptions(deviation_pool=2, budget="adaptive")


def test_chunk_sinks_recompute_each_chunks_first_tokens_within_the_budget(setup):
    """chunk_sinks=k: the first k tokens of every chunk come first (the chunks start at 6, 28
    and 52), the rest of the budget goes by mass; toy masses, exact positions."""
    from qcfuse_core.selection.selectors import chunk_heads

    m, prompt = setup
    heads = chunk_heads(prompt, 2)
    assert torch.nonzero(heads).flatten().tolist() == [6, 7, 28, 29, 52, 53]
    mass = torch.zeros(prompt.num_tokens)
    mass[torch.tensor([40, 25, 60, 28])] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    ctx = SelectionContext(m, prompt, 8 / 62)  # a budget of 8 chunk tokens
    sel = get_selector("qcfuse").choose(ctx, QCFuseOptions(chunk_sinks=2), mass.clone(), {})
    assert sel.details["positions"].tolist() == [6, 7, 25, 28, 29, 40, 52, 53]  # 6 heads + the 2 best others
    assert sel.details["chunk_sinks"] == 2 and torch.equal(sel.details["selected_scores"], mass[sel.details["positions"]])
    _check_rules(prompt, sel.rows)
    small = get_selector("qcfuse").choose(SelectionContext(m, prompt, 4 / 62), QCFuseOptions(chunk_sinks=2), mass.clone(), {})
    assert small.details["positions"].tolist() == [6, 7, 28, 29]  # a budget below the heads: the earliest heads
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_sinks"):
            QCFuseOptions(chunk_sinks=bad)
    with pytest.raises(ValueError, match="fixed"):
        QCFuseOptions(chunk_sinks=2, budget="adaptive")


def test_position_prior_reweights_the_ranking_by_position_inside_the_chunk(setup):
    """position_prior=a: chunk tokens ranked by mass x (1 + position inside their chunk)^-a -
    exact on toy masses (the first chunk starts at 6, the second at 28, the third at 52)."""
    from qcfuse_core.selection.selectors import chunk_position_prior

    m, prompt = setup
    prior = chunk_position_prior(prompt, 1.0)
    assert prior[:6].tolist() == [1.0] * 6 and prior[26:28].tolist() == [1.0, 1.0] and prior[68:].eq(1).all()
    assert prior[6].item() == 1.0 and prior[7].item() == 0.5 and prior[28].item() == 1.0
    assert prior[52 + 3].item() == pytest.approx(0.25) and prior[25].item() == pytest.approx(1 / 20)
    assert torch.allclose(chunk_position_prior(prompt, 0.5) ** 2, prior, rtol=1e-6, atol=0)
    mass = torch.zeros(prompt.num_tokens)
    # by mass alone: 40 (5.0), 25 (4.0), 60 (3.0); weighted by 1/(1 + position): 28 (2.0 x 1),
    # 52 (1.0 x 1), 53 (1.5 x 1/2), 40 (5.0 x 1/13 = 0.38), 25 (4.0 x 1/20), 60 (3.0 x 1/9)
    mass[torch.tensor([40, 25, 60, 28, 52, 53])] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 1.5])
    ctx = SelectionContext(m, prompt, 3 / 62)
    plain = get_selector("qcfuse").choose(ctx, QCFuseOptions(), mass.clone(), {})
    weighted = get_selector("qcfuse").choose(ctx, QCFuseOptions(position_prior=1.0), mass.clone(), {})
    assert plain.details["positions"].tolist() == [25, 40, 60]
    assert weighted.details["positions"].tolist() == [28, 52, 53]
    assert torch.equal(weighted.details["selected_scores"], mass[[28, 52, 53]])  # scores stay the mass
    assert weighted.details["position_prior"] == 1.0
    _check_rules(prompt, weighted.rows)
    sel = get_selector("qcfuse").select(SelectionContext(m, prompt, 0.25, options={"position_prior": 0.5}))
    base = get_selector("qcfuse").select(SelectionContext(m, prompt, 0.25))
    m_all = torch.zeros(prompt.num_tokens)
    m_all[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = base.scores
    want = top_budget(CHUNK, (m_all * chunk_position_prior(prompt, 0.5))[CHUNK], 16)
    assert torch.equal(sel.details["positions"], want)
    for bad in (-0.1, 5, True, "0.5"):
        with pytest.raises(ValueError, match="position_prior"):
            QCFuseOptions(position_prior=bad)
    # the adaptive budget counts its target on the weighted scores: of 4.67 in all, half is
    # reached by 28 (2.0) and 52 (1.0); by the mass alone (16.5) by 40 (5.0) and 25 (4.0)
    for prior, want in ((1.0, [28, 52]), (0.0, [25, 40])):
        opts = QCFuseOptions(budget="adaptive", position_prior=prior, target_mass=0.5, floor=0.0, ceiling=0.5)
        got = get_selector("qcfuse").choose(ctx, opts, mass.clone(), {})
        assert got.details["positions"].tolist() == want and got.details["budget_mode"] == "adaptive"


def test_prior_depth_stops_the_position_prior_falling(setup):
    """prior_depth=d: the prior is (1 + min(position, d))^-a, so deeper tokens compete by mass -
    exact on the toy masses above (chunks start at 6, 28 and 52)."""
    from qcfuse_core.selection.selectors import chunk_position_prior

    m, prompt = setup
    prior = chunk_position_prior(prompt, 1.0, depth=2)
    assert prior[6].item() == 1.0 and prior[7].item() == 0.5 and prior[8].item() == pytest.approx(1 / 3)
    assert prior[6 + 19].item() == pytest.approx(1 / 3) and prior[:6].eq(1).all() and prior[68:].eq(1).all()
    assert torch.equal(chunk_position_prior(prompt, 1.0, depth=0), chunk_position_prior(prompt, 1.0))
    mass = torch.zeros(prompt.num_tokens)
    # weighted by 1/(1 + min(position, 2)): 28 (2.0 x 1), 40 (5.0 / 3), 25 (4.0 / 3), then
    # 60 (3.0 / 3) and 52 (1.0 x 1), 53 (1.5 / 2); without the depth 28, 52, 53 (test above)
    mass[torch.tensor([40, 25, 60, 28, 52, 53])] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 1.5])
    ctx = SelectionContext(m, prompt, 3 / 62)
    got = get_selector("qcfuse").choose(ctx, QCFuseOptions(position_prior=1.0, prior_depth=2), mass.clone(), {})
    assert got.details["positions"].tolist() == [25, 28, 40] and got.details["prior_depth"] == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prior_depth"):
            QCFuseOptions(position_prior=1.0, prior_depth=bad)
    with pytest.raises(ValueError, match="set position_prior"):
        QCFuseOptions(prior_depth=8)


def test_qcall_uses_every_layer(setup):
    m, prompt = setup
    sel = get_selector("qcall").select(SelectionContext(m, prompt, 0.2))
    _check_rules(prompt, sel.rows)
    assert sel.details["critical_layers"] == [0, 1, 2]


def test_cacheblend_recomputes_two_layers_then_the_top_v_deviation(setup):
    from qcfuse_core.model.fusion import fused_prefill

    m, prompt = setup
    ctx = SelectionContext(m, prompt, 0.2)
    sel = get_selector("cacheblend").select(ctx)
    assert sel.full_layers == 2 and sel.on_layer_end is not None
    seen = {}

    def spy(state):
        seen[state.layer] = state.rows.numel()
        return sel.on_layer_end(state)

    out = fused_prefill(m, prompt, sel.rows, full_layers=sel.full_layers, on_layer_end=spy)
    assert seen[0] == seen[1] == prompt.num_tokens and seen[2] == ctx.budget + len(GLUE) + len(SUFFIX)
    _check_rules(prompt, out.rows)
    assert torch.equal(out.rows, sel.rows)
    # the chosen tokens are exactly the top V deviations at layer 1
    dev = sel.scores  # over chunk + glue positions
    ctx_pos = torch.nonzero(prompt.mask("chunk", "text")).flatten()
    chunk_only = prompt.mask("chunk")[ctx_pos]
    expect = top_budget(ctx_pos[chunk_only], dev[chunk_only], ctx.budget)
    assert torch.equal(sel.details["positions"], expect)


def test_epic_random_naive(setup):
    m, prompt = setup
    ctx = SelectionContext(m, prompt, 0.15, seed=3)  # budget 9 -> 3 per chunk
    epic = get_selector("epic").select(ctx)
    assert epic.rows.tolist() == [6, 7, 8, 26, 27, 28, 29, 30, 52, 53, 54] + SUFFIX
    r1, r2 = get_selector("random").select(ctx), get_selector("random").select(ctx)
    assert torch.equal(r1.rows, r2.rows) and r1.rows.numel() == 9 + 2 + 7
    _check_rules(prompt, r1.rows)
    assert get_selector("naive").select(ctx).rows.tolist() == GLUE + SUFFIX


def test_unknown_names_and_bad_options_raise():
    # the oracle (a bound, not a method) is registered by qcfuse_core.eval.oracle only
    with pytest.raises(ValueError, match="adaptive, cacheblend, epic, full, naive, (oracle, )?qcall, qcfuse, qclast, random$"):
        get_selector("magic")
    import qcfuse_core.eval.oracle  # noqa: F401

    with pytest.raises(ValueError, match="adaptive, cacheblend, epic, full, naive, oracle, qcall, qcfuse, qclast, random$"):
        get_selector("magic")
    with pytest.raises(ValueError, match="fixed, adaptive"):
        QCFuseOptions(budget="greedy")
    with pytest.raises(ValueError, match="floor"):
        QCFuseOptions(floor=0.6, ceiling=0.5)


def test_critical_layer_lookup(monkeypatch, tmp_path):
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path))
    m = tiny_model("llama")
    m.name = "Meta-Llama-3.1-8B-Instruct"
    m.shape = m.shape.__class__(**{**m.shape.__dict__, "num_layers": 32})
    assert critical_layers.lookup(m)[0] == [14, 13, 16]
    m.name = "some-unknown-model"
    layers, source = critical_layers.lookup(m)
    assert source == "depth heuristic" and layers == [14, 17, 20]
    critical_layers.save_profile({"layers": [3, 5]}, None, m)
    assert critical_layers.lookup(m) == ([3, 5], f"profile {tmp_path}/critical_layers/{m.fingerprint()}.json")
    with pytest.raises(ValueError, match="do not fit"):
        critical_layers.save_profile({"layers": [40]}, None, m)


def test_spread_scores_pin_values_and_keep_the_peak_first():
    from qcfuse_core.selection.selectors import spread_scores

    mass = torch.tensor([0.0, 0.0, 0.8, 0.0, 0.1, 0.0, 0.0, 0.0])
    assert torch.equal(spread_scores(mass, 0), mass)
    got = spread_scores(mass, 1)
    want = torch.tensor([0.0, 0.4, 0.8, 0.4, 0.1, 0.05, 0.0, 0.0])
    assert torch.allclose(got, want)
    assert int(torch.argmax(got)) == 2  # the attended token itself ranks first
    with pytest.raises(ValueError, match="spread"):
        QCFuseOptions(spread=-1)


def test_spread_selects_the_neighbours_of_attended_tokens():
    """Fixed budget on a toy mass: with spread 1 the peak's neighbours displace a lone
    weaker token; mass_covered still reports the real mass share."""
    m = tiny_model("llama")
    prompt = prompt_alone(m)
    T = prompt.num_tokens
    chunk = torch.nonzero(prompt.mask("chunk")).flatten()
    mass = torch.zeros(T)
    peak, lone = int(chunk[10]), int(chunk[40])
    mass[peak], mass[lone] = 0.6, 0.2
    sel = QueryAwareSelector.choose
    ctx = SelectionContext(m, prompt, 3 / prompt.context_tokens)
    assert ctx.budget == 3
    plain = sel(get_selector("qcfuse"), ctx, QCFuseOptions(), mass.clone(), {})
    spread = sel(get_selector("qcfuse"), ctx, QCFuseOptions(spread=1), mass.clone(), {})
    assert plain.details["positions"].tolist() == sorted([int(chunk[0]), peak, lone])  # zeros: earliest first
    assert spread.details["positions"].tolist() == [peak - 1, peak, peak + 1]
    assert spread.details["mass_covered"] == pytest.approx(0.6 / 0.8)
    assert plain.details["mass_covered"] == pytest.approx(1.0)


def test_chunk_quotas_pin_values():
    from qcfuse_core.selection.scoring import chunk_quotas

    assert chunk_quotas([0.5, 0.3, 0.2], [10, 10, 10], 10) == [5, 3, 2]
    assert chunk_quotas([0.9, 0.1], [4, 10], 10) == [4, 6]  # a full chunk's excess goes to the others
    assert chunk_quotas([1.0, 1.0, 1.0], [5, 5, 5], 4) == [2, 1, 1]  # largest remainder, earlier first
    assert chunk_quotas([0.0, 0.0], [3, 9], 6) == [2, 4]  # no mass: by length (1.5 / 4.5, tie to the first)
    assert chunk_quotas([0.2, 0.8], [3, 3], 100) == [3, 3]  # capped at the chunks' tokens
    assert chunk_quotas([], [], 5) == [] and chunk_quotas([1.0], [7], 0) == [0]
    with pytest.raises(ValueError, match="one mass per chunk"):
        chunk_quotas([1.0], [1, 2], 1)


def test_chunk_allocation_spreads_the_budget_over_chunks():
    """allocation='chunk': each chunk gets budget x its share of the mass, its own top tokens
    inside; the default global top-k takes the best tokens wherever they are."""
    m = tiny_model("llama")
    prompt = prompt_alone(m)
    spans = prompt.chunk_spans()
    assert len(spans) >= 2
    T = prompt.num_tokens
    mass = torch.zeros(T)
    (s0, e0), (s1, e1) = spans[0], spans[1]
    mass[s0:e0] = 0.001  # the first chunk: weak everywhere, 25% of the mass in total
    mass[s0 + 2] = 0.002
    mass[s1:e1] = torch.linspace(0.01, 0.02, e1 - s1)
    mass[s0:e0] *= 0.25 * float(mass[s1:e1].sum()) / 0.75 / float(mass[s0:e0].sum())
    ctx = SelectionContext(m, prompt, 8 / prompt.context_tokens)
    assert ctx.budget == 8
    sel = QueryAwareSelector.choose
    glob = sel(get_selector("qcfuse"), ctx, QCFuseOptions(), mass.clone(), {})
    chunk = sel(get_selector("qcfuse"), ctx, QCFuseOptions(allocation="chunk"), mass.clone(), {})
    assert all(s1 <= p < e1 for p in glob.details["positions"].tolist())  # global: all from the strong chunk
    got = chunk.details["positions"].tolist()
    assert len(got) == 8 and s0 + 2 in got  # the weak chunk's best token
    assert sum(s0 <= p < e0 for p in got) == 2 and sum(s1 <= p < e1 for p in got) == 6  # 25% / 75% of 8
    assert got[-6:] == list(range(e1 - 6, e1))  # the strong chunk's own top tokens
    assert chunk.details["allocation"] == "chunk" and chunk.details["budget"] == 8
    with pytest.raises(ValueError, match="allocation"):
        QCFuseOptions(allocation="nope")
    with pytest.raises(ValueError, match="fixed budget"):
        QCFuseOptions(allocation="chunk", budget="adaptive")
