"""The selection bound (`oracle`), the calibrated adaptive budget (`adaptive`), the answer-level
metric and storage round trips of `bench quality`.

Toy prompt layout (tests/qc_fixtures.py):
    [prefix 0..5][chunk 6..25][glue 26..27][chunk 28..51][chunk 52..67][suffix 68..74]
"""

import json

import pytest
import torch

from qcfuse_core.eval import calibration
from qcfuse_core.selection import adaptive
from qcfuse_core.eval import oracle
from qcfuse_core.eval.datasets import load_dataset
from qcfuse_core.selection.scoring import top_budget
from qcfuse_core.selection.base import SelectionContext, get_selector
from qcfuse_core.eval.hooks import internals
from qcfuse_core.store import MemoryStore
from qcfuse_core.model.testing import tiny_model
from tests.qc_fixtures import prompt_alone

SUFFIX = list(range(68, 75))
GLUE = [26, 27]


@pytest.fixture(scope="module")
def setup():
    m = tiny_model("llama")
    return m, prompt_alone(m)


def test_staleness_normalises_each_layer_by_its_chunk_mean():
    chunk = torch.tensor([False, True, True, True])
    dk = torch.tensor([[0.0, 0.0, 0.0, 0.0],    # layer 0: no deviation (contributes 0, not NaN)
                       [9.0, 1.0, 2.0, 3.0]])   # chunk mean 2 -> 0.5, 1, 1.5 (position 0 is not chunk)
    dv = torch.tensor([[5.0, 4.0, 0.0, 2.0],    # chunk mean 2 -> 2, 0, 1
                       [0.0, 1.0, 1.0, 4.0]])   # chunk mean 2 -> 0.5, 0.5, 2
    s = oracle.staleness(dk, dv, chunk)
    assert s[1:].tolist() == pytest.approx([0.5 + 2 + 0.5, 1 + 0 + 0.5, 1.5 + 1 + 2])
    assert s[0] == pytest.approx(4.5 + 2.5 + 0.0)


def test_oracle_deviations_equal_fresh_minus_cached_kv_from_hf(setup):
    """The oracle's per-layer deviations are |fresh - cached|^2 of pre-RoPE K and of V, fresh
    read from HF's own forward (layer inputs -> input norm -> k/v projections), cached from
    the chunks computed alone; layer 0 has none (a token's layer-0 K/V ignore its context)."""
    m, prompt = setup
    dk, dv = oracle.deviations(m, prompt)
    L, T = m.num_layers, prompt.num_tokens
    assert dk.shape == dv.shape == (L, T)
    hf = m.model
    with torch.no_grad():
        hs = hf(prompt.token_ids[None], output_hidden_states=True).hidden_states
    hkv = hf.config.num_key_value_heads
    for (s, e), seg in zip(prompt.chunk_spans(), [x for x in prompt.segments if x.kind == "chunk"]):
        for layer in range(L):
            blk = hf.model.layers[layer]
            with torch.no_grad():
                x = blk.input_layernorm(hs[layer][0, s:e])
                k = blk.self_attn.k_proj(x).view(e - s, hkv, -1)
                v = blk.self_attn.v_proj(x).view(e - s, hkv, -1)
            want_k = (k - seg.chunk.k[layer]).pow(2).sum((1, 2))
            want_v = (v - seg.chunk.v[layer]).pow(2).sum((1, 2))
            torch.testing.assert_close(dk[layer, s:e], want_k, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(dv[layer, s:e], want_v, atol=1e-5, rtol=1e-4)
    chunk = prompt.mask("chunk")
    assert float(dk[0, chunk].abs().max()) < 1e-8 and float(dv[0, chunk].abs().max()) < 1e-8
    assert float(dk[1:, chunk].sum()) > 0 and float(dv[1:, chunk].sum()) > 0


def test_oracle_selects_the_top_mass_times_staleness(setup):
    """Exact rows: the top budget chunk tokens by qcfuse's probed mass x the staleness, plus
    glue and suffix; the staleness is computed once per prompt."""
    m, _ = setup
    prompt = prompt_alone(m)  # its own prompt: the oracle memo lives on the prompt object
    ctx = SelectionContext(m, prompt, 0.2)
    q = get_selector("qcfuse").select(ctx)
    mass = torch.zeros(prompt.num_tokens)
    mass[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = q.scores
    dk, dv = oracle.deviations(m, prompt)
    score = mass * oracle.staleness(dk, dv, prompt.mask("chunk"))
    cand = torch.nonzero(prompt.mask("chunk")).flatten()
    want = top_budget(cand, score[cand], ctx.budget)
    sel = get_selector("oracle").select(ctx)
    assert sel.method == "oracle" and not sel.details["oracle_reused"]
    assert sel.details["positions"].tolist() == want.tolist() and len(want) == ctx.budget == 12
    assert sel.rows.tolist() == sorted(want.tolist() + GLUE + SUFFIX)
    assert sel.details["positions"].tolist() != q.details["positions"].tolist()  # staleness re-ranks
    again = get_selector("oracle").select(SelectionContext(m, prompt, 0.3))
    assert again.details["oracle_reused"] and len(again.details["positions"]) == 19  # round(0.3 x 62)
    assert get_selector("oracle").probes and get_selector("adaptive").probes


def test_oracle_ignores_qcfuses_ranking_options(setup):
    """A profile's ranking options (the Gemma profile's position prior with its depth, chunk
    sinks) do not touch the oracle's ranking: the same rows as without them."""
    m, _ = setup
    prompt = prompt_alone(m)
    plain = get_selector("oracle").select(SelectionContext(m, prompt, 0.2))
    ranked = get_selector("oracle").select(SelectionContext(
        m, prompt, 0.2, options={"position_prior": 2, "prior_depth": 4, "chunk_sinks": 2, "spread": 1}))
    assert ranked.rows.tolist() == plain.rows.tolist()
    assert ranked.details["positions"].tolist() == plain.details["positions"].tolist()


def test_oracle_refuses_lazy_chunk_views(setup):
    from dataclasses import replace

    from qcfuse_core.model.fusion import FusedPrompt

    m, prompt = setup

    class View:  # stands for a store's lazy ChunkView: not an in-memory KVChunk
        num_tokens = 20

    segs = [replace(s, chunk=View()) if i == 1 else s for i, s in enumerate(prompt.segments)]
    with pytest.raises(ValueError, match="in memory"):
        oracle.deviations(m, FusedPrompt(segs))


def test_adaptive_target_interpolates_and_refuses_outside():
    cal = {"targets": {"0.1": 0.5, "0.3": 0.9}}
    assert adaptive.target_for(cal, 0.1) == 0.5
    assert adaptive.target_for(cal, 0.2) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="outside the calibrated"):
        adaptive.target_for(cal, 0.35)


def test_solve_target_hits_the_mean_share_exactly_on_toy_masses():
    # two questions, 10 candidates each, context 10, no glue: share = adaptive count / 10
    a = torch.tensor([5.0, 1, 1, 1, 1, 0.5, 0.5, 0, 0, 0])
    b = torch.ones(10)
    masses = [(a, 10, 0), (b, 10, 0)]
    t = calibration.solve_target(masses, 0.3, floor=0.0, ceiling=1.0)
    assert calibration.mean_share(masses, t, 0.0, 1.0) == pytest.approx(0.3)
    # at that target: question a needs 1 token (5/11 covers t), question b 5 (t of 10 equal tokens)
    assert 5 / 11 >= t > 0.4 and calibration.mean_share(masses, 0.4, 0.0, 1.0) < 0.3
    with pytest.raises(ValueError, match="out of reach"):
        calibration.solve_target(masses, 0.6, floor=0.0, ceiling=0.5)


def test_adaptive_selector_is_qcfuse_with_the_calibrated_target(setup, monkeypatch):
    m, prompt = setup
    cal = {"targets": {"0.1": 0.4, "0.3": 0.8}, "floor": 0.0, "ceiling": 0.5}
    monkeypatch.setattr(adaptive, "lookup_calibration", lambda adapter: (cal, "test"))
    sel = get_selector("adaptive").select(SelectionContext(m, prompt, 0.2))
    want = get_selector("qcfuse").select(SelectionContext(m, prompt, 0.2, options=dict(
        budget="adaptive", target_mass=0.6, floor=0.0, ceiling=0.5)))
    assert sel.method == "adaptive" and sel.details["target_mass"] == pytest.approx(0.6)
    assert sel.rows.tolist() == want.rows.tolist() and sel.details["budget_mode"] == "adaptive"
    monkeypatch.setattr(adaptive, "lookup_calibration", lambda adapter: (None, "none"))
    with pytest.raises(ValueError, match="calibrate-budget"):
        get_selector("adaptive").select(SelectionContext(m, prompt, 0.2))


def test_calibrate_matches_the_requested_mean_share(setup, tmp_path, monkeypatch):
    """calibrate() on a two-question toy set: each share's target gives that mean share to
    within one token per question; the saved file is what lookup_calibration reads."""
    from qcfuse_core.engine.api import QCFuseEngine

    m = tiny_model("llama", tokenizer=True)
    engine = QCFuseEngine(m)
    data = tmp_path / "toy_s.json"
    rows = [{"question": f"Which town is number {i}?", "answers": ["x"],
             "ctxs": [{"title": "", "text": f"Town {i} lies by the river; its mill was built in 18{i}0 by a miller. " * 3},
                      {"title": "", "text": "The valley holds several towns and a long, slow river. " * 3}]}
            for i in range(2)]
    data.write_text(json.dumps(rows))
    cal = calibration.calibrate(engine, str(data), shares=(0.15, 0.3, 0.01), options={"critical_layers": [1]})
    assert cal["n"] == 2 and set(cal["targets"]) == {"0.15", "0.3"}
    assert cal["unreachable_shares"] == [0.01]  # below the 0.05 floor: skipped, the others kept
    masses = calibration.question_masses(engine, str(data), limit=None, options={"critical_layers": [1]})
    tol = max(1 / c for _, c, _ in masses)  # one token of the shortest context
    for s in (0.15, 0.3):
        assert abs(calibration.mean_share(masses, cal["targets"][f"{s:g}"], 0.05, 0.5) - s) <= tol
    assert cal["targets"]["0.15"] < cal["targets"]["0.3"]
    path = calibration.save_calibration(cal, tmp_path / "cal.json", m)
    assert json.loads(path.read_text())["targets"] == cal["targets"]
    assert cal["critical_layers"] == [1] and cal["options"] == {}

    # with a position prior the count adds up the weighted scores, and the adaptive method at
    # the calibrated share realises it on the calibration questions (within a token each)
    opts = {"critical_layers": [1], "position_prior": 2.0}
    cal = calibration.calibrate(engine, str(data), shares=(0.15, 0.3), options=opts)
    assert cal["options"] == {"position_prior": 2.0}
    weighted = calibration.question_masses(engine, str(data), limit=None, options=opts)
    plain = calibration.question_masses(engine, str(data), limit=None, options={"critical_layers": [1]})
    assert not torch.equal(weighted[0][0], plain[0][0])
    monkeypatch.setattr(adaptive, "lookup_calibration", lambda adapter: (cal, "test"))
    for s in (0.15, 0.3):
        shares = []
        for ex in load_dataset(str(data), limit=None):
            engine = internals(engine).replace(store=MemoryStore())
            prompt, _, _ = engine._steps.fuse_pieces(engine.frame.rag_pieces(ex.question, list(ex.passages)))
            sel = engine._steps.select(prompt, "adaptive", s, options=opts).selection
            assert sel.details["position_prior"] == 2.0
            shares.append((sel.details["budget"] + int(prompt.mask("text").sum())) / prompt.context_tokens)
        assert abs(sum(shares) / len(shares) - s) <= tol
    with pytest.raises(ValueError, match="ranking options"):
        engine._steps.select(prompt, "adaptive", 0.3, options={"critical_layers": [1]})


def test_forced_logits_equal_a_teacher_forced_fused_prefill(smol_engine):
    """Teacher forcing by decode steps on a method's prompt cache gives the logits of
    quality.teacher_fused (the seq rows recomputed over the same cache), for a method
    whose rows change inside the prefill (cacheblend) and a probing one."""
    from qcfuse_core.eval.quality import forced_logits, teacher_fused
    from qcfuse_core.engine.request import Planned
    from qcfuse_core.store import MemoryStore

    eng = internals(smol_engine).replace(store=MemoryStore())
    pieces = eng.frame.rag_pieces("Who founded the Zephyr Institute?",
                            ["The Zephyr Institute was founded in 1931 by Ada Ferreira.", "Cape Wrayth has a port."])
    loading = eng._steps.start_loading(eng._steps.lookup(pieces, "naive", streaming=False), Planned("naive", frozenset()))
    seq = eng.caches.tokenize(" Ada Ferreira founded it.").tolist()
    for method in ("cacheblend", "qcfuse"):
        sel = eng._steps.select(loading.prompt, method, 0.3)
        teacher = teacher_fused(eng, loading, sel, method, torch.tensor(seq))[0]  # (len + 1, vocab)
        sel = eng._steps.select(loading.prompt, method, 0.3)
        pre = eng._steps.fuse(loading, sel, method, capacity=len(seq))
        got = forced_logits(eng, pre.cache, pre.logits[-1], seq)
        assert got.shape == (len(seq), teacher.shape[1]) and pre.cache.length == loading.prompt.num_tokens
        torch.testing.assert_close(got, teacher[: len(seq)], atol=2e-4, rtol=1e-4)


def test_run_example_answer_kl_storage_and_bound_methods(smol_engine, monkeypatch):
    """Every record has the answer-level KL (0 for full prefill through the fused path, its
    first token's value equal to the first-token KL); `oracle` and `adaptive` run as methods;
    storage="fp8" renames the records and moves the fused caches, not the selection."""
    from qcfuse_core.eval.quality import run_example
    from tests.test_quality_bench import _toy_example

    monkeypatch.setattr(adaptive, "lookup_calibration",
                        lambda a: ({"targets": {"0.15": 0.5, "0.3": 0.8}, "floor": 0.05, "ceiling": 0.5}, "test"))
    ex = _toy_example()
    variants = [("qcfuse", "qcfuse", 0.3, {}), ("oracle", "oracle", 0.3, {}), ("adaptive", "adaptive", 0.3, {}),
                ("naive", "naive", None, {}), ("full-fused", "full", None, {})]
    recs = run_example(smol_engine, ex, None, None, {}, max_new=8, variants=variants)
    by = {r.get("variant", r["method"]): r for r in recs}
    assert by["full"]["answer_kl"] == 0.0 and by["full-fused"]["answer_kl"] < 1e-6
    for name in ("qcfuse", "oracle", "adaptive", "naive"):
        r = by[name]
        assert len(r["answer_kl_tokens"]) == r["answer_tokens"] == by["full"]["answer_tokens"] > 1
        assert r["answer_kl_tokens"][0] == pytest.approx(r["kl_first_token"], abs=1e-5)
        assert r["answer_kl"] == pytest.approx(sum(r["answer_kl_tokens"]) / r["answer_tokens"], abs=1e-5)
    assert by["naive"]["answer_kl"] > by["qcfuse"]["answer_kl"] > 0
    assert by["adaptive"]["target_mass"] == pytest.approx(0.8) and by["oracle"]["recompute_share"] == pytest.approx(
        by["qcfuse"]["recompute_share"])
    fp8 = run_example(smol_engine, ex, ["full", "qcfuse", "naive"], [0.3], {}, max_new=8, storage="fp8")
    assert [r["method"] for r in fp8] == ["full", "qcfuse:fp8", "naive:fp8"]
    assert fp8[0]["answer"] == by["full"]["answer"]
    assert fp8[1]["recompute_share"] == by["qcfuse"]["recompute_share"]  # same selection (exact caches)
    assert fp8[2]["kl_first_token"] != by["naive"]["kl_first_token"]  # fused from the fp8 round trip


def test_round_trip_goes_through_the_codec(setup):
    from qcfuse_core.eval.quality import round_trip
    from qcfuse_core.store.codec import decode_layer, encode_layer

    m, prompt = setup
    assert round_trip(prompt, "auto") is prompt
    rt = round_trip(prompt, "fp8")
    for a, b in zip(prompt.segments, rt.segments):
        if a.chunk is None:
            assert b.chunk is None
            continue
        kv, scale = encode_layer(a.chunk.k[1], a.chunk.v[1], torch.float8_e4m3fn)
        want = decode_layer(kv, scale, torch.float32)
        assert torch.equal(b.chunk.k[1], want[0]) and torch.equal(b.chunk.v[1], want[1])
        assert not torch.equal(b.chunk.k, a.chunk.k) and b.chunk.anchors == {}
    with pytest.raises(ValueError, match="storage dtype"):
        round_trip(prompt, "int4")


def test_the_embedded_model_ships_its_calibration(smol, monkeypatch, tmp_path):
    """The packaged calibration (musique_train) resolves for the embedded model at the two
    reported shares, without a user file."""
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path))  # (the model is loaded already)
    cal, source = adaptive.lookup_calibration(smol)
    assert cal is not None and source.startswith("packaged calibration SmolLM2-135M-Instruct")
    t15, t30 = adaptive.target_for(cal, 0.15), adaptive.target_for(cal, 0.3)
    assert 0 < t15 < t30 <= 1 and cal["mean_share_at_target"]["0.15"] == pytest.approx(0.15, abs=1e-3)


def test_adaptive_serves_through_engine_answer_and_oracle_refuses_streamed_caches(tmp_path, monkeypatch):
    """`adaptive` is a serving method: engine.answer on a tiered store (layers streamed) runs
    it with the calibrated target; `oracle` needs every cache in memory and says so."""
    from qcfuse_core import EngineConfig, QCFuseOptions, open_engine

    m = tiny_model("llama", tokenizer=True)
    monkeypatch.setattr("qcfuse_core.engine.api._ADAPTERS", {("None", "None", "cpu"): m})
    monkeypatch.setattr(adaptive, "lookup_calibration",
                        lambda a: ({"targets": {"0.1": 0.5, "0.3": 0.9}, "floor": 0.05, "ceiling": 0.5}, "test"))
    engine = open_engine(tmp_path / "store", config=EngineConfig(selection=QCFuseOptions(critical_layers=(1,))))
    docs = ["The mill by the river was built in 1840 by a miller. " * 2, "A long, slow river runs through the valley. " * 2]
    engine.build_chunks(docs, ["a", "b"])
    res = engine.answer("Who built the mill?", docs, node_ids=["a", "b"], method="adaptive", ratio=0.2, max_new_tokens=2)
    assert res.method == "adaptive" and res.cache_hits == 2 and 0 < res.recomputed_tokens < res.context_tokens
    with pytest.raises(ValueError, match="in memory"):
        engine.answer("Who built the mill?", docs, node_ids=["a", "b"], method="oracle", ratio=0.2, max_new_tokens=2)
