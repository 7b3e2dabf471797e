"""Critical-layer profiler (`qcfuse profile-layers`) on the embedded model, toy calibration set."""

import json

import pytest
import torch

from qcfuse_core.eval import metrics as M
from qcfuse_core.selection.anchors import AnchorConfig
from qcfuse_core.model.fusion import fused_prefill
from qcfuse_core.eval.profile_layers import format_ranking, prepare_example, profile_layers, score_set
from qcfuse_core.selection.base import SelectionContext, get_selector

QUESTIONS = [
    ("Who founded the Zephyr Institute?",
     ["The Zephyr Institute studies ocean currents. It was founded in 1931 by the marine biologist Ada "
      "Ferreira on the island of Cape Wrayth.",
      "The Lantern Festival began in 1952 in the port of Cape Wrayth, where lanterns are lit every autumn.",
      "Cape Wrayth has a lighthouse built in 1890 and a ferry to the mainland twice a day."],
     ["Ada Ferreira"]),
    ("When did the Lantern Festival begin?",
     ["The Lantern Festival began in 1952 in the port of Cape Wrayth, where lanterns are lit every autumn.",
      "Ada Ferreira, a marine biologist, founded the Zephyr Institute in 1931.",
      "The ferry to Cape Wrayth was replaced by a bridge in 1977, which the islanders opposed."],
     ["1952"]),
]
LAYERS = [2, 5, 8]


@pytest.fixture()
def toy_set(tmp_path):
    path = tmp_path / "toy_s.json"
    path.write_text(json.dumps([{"question": q, "answers": a, "ctxs": [{"title": "", "text": p} for p in ps]}
                                for q, ps, a in QUESTIONS]))
    return path


def test_a_layer_set_scores_what_the_qcfuse_selector_does_with_those_critical_layers(smol_engine):
    """The profiler's score of a layer set is the first-token KL of the shipped qcfuse selector
    run with `critical_layers` = that set, against HF's own full prefill."""
    adapter = smol_engine.adapter
    q, passages, _ = QUESTIONS[0]
    prep = prepare_example(smol_engine, q, passages, AnchorConfig(), LAYERS)
    assert sorted(prep.mass) == LAYERS and all(m.shape == (prep.prompt.num_tokens,) for m in prep.mass.values())
    full = adapter.hf_forward(prep.prompt.token_ids, keep=1)[0][-1]
    assert torch.equal(full, prep.ref)
    kls = []
    for layer_set in ([5], [8], [5, 8], [2, 5, 8]):
        kl, agree = score_set(smol_engine, prep, layer_set, 0.3)
        sel = get_selector("qcfuse").select(SelectionContext(adapter, prep.prompt, 0.3,
                                                             options={"critical_layers": layer_set}))
        logits = fused_prefill(adapter, prep.prompt, sel.rows, logits_last=1).logits[-1]
        assert kl == pytest.approx(M.kl_divergence(full, logits), rel=1e-4, abs=1e-7)
        assert agree == float(int(logits.argmax()) == int(full.argmax()))
        kls.append(kl)
    assert len(set(kls)) > 1  # the sets really select differently
    # every chunk token recomputed: the fused prefill is full prefill
    kl_all, agree_all = score_set(smol_engine, prep, [5], 1.0)
    assert kl_all < 1e-6 and agree_all == 1.0


def test_profile_singles_and_greedy(smol_engine, toy_set):
    preps = [prepare_example(smol_engine, q, ps, AnchorConfig(), LAYERS) for q, ps, _ in QUESTIONS]

    def mean_kl(layer_set):
        return sum(score_set(smol_engine, p, layer_set, 0.3)[0] for p in preps) / len(preps)

    singles = profile_layers(smol_engine, str(toy_set), limit=None, ratio=0.3, top_k=2, layers=LAYERS)
    assert singles["search"] == "singles" and singles["n"] == 2 and "steps" not in singles
    for r in singles["ranking"]:
        assert r["kl"] == pytest.approx(mean_kl([r["layer"]]), rel=1e-4, abs=1e-7)
    kl_order = [r["kl"] for r in singles["ranking"]]
    assert kl_order == sorted(kl_order) and singles["layers"] == [r["layer"] for r in singles["ranking"][:2]]

    greedy = profile_layers(smol_engine, str(toy_set), limit=None, ratio=0.3, top_k=3, layers=LAYERS, search="greedy")
    assert greedy["ranking"] == singles["ranking"]
    steps = greedy["steps"]
    assert steps[0]["layers"] == [singles["ranking"][0]["layer"]]
    assert greedy["layers"] == steps[-1]["layers"] and 1 <= len(steps) <= 3
    for prev, step in zip(steps, steps[1:]):
        assert step["layers"][:-1] == prev["layers"] and step["kl"] < prev["kl"]
        # the added layer is the best addition of all the remaining ones
        trials = {c: mean_kl(prev["layers"] + [c]) for c in LAYERS if c not in prev["layers"]}
        assert step["layers"][-1] == min(trials, key=trials.get)
        assert step["kl"] == pytest.approx(trials[step["layers"][-1]], rel=1e-4, abs=1e-7)
    if len(steps) < 3:  # stopped: no remaining layer lowers the set's KL
        last = steps[-1]
        assert all(mean_kl(last["layers"] + [c]) >= last["kl"] - 1e-7 for c in LAYERS if c not in last["layers"])
    assert "greedy set" in format_ranking(greedy)
    with pytest.raises(ValueError, match="search must be one of"):
        profile_layers(smol_engine, str(toy_set), layers=LAYERS, search="beam")


def test_cli_profile_layers_greedy_writes_the_profile(toy_set, tmp_path, capsys):
    from qcfuse_core.cli.commands import main

    out = tmp_path / "profile.json"
    assert main(["profile-layers", "--dataset", str(toy_set), "--ratio", "0.3", "--critical-layers", "2,5",
                 "--search", "greedy", "--top", "2", "--threads", "1", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["search"] == "greedy" and prof["layers"] == prof["steps"][-1]["layers"]
    assert set(prof["layers"]) <= {2, 5} and "--search greedy" in prof["source"]
    printed = capsys.readouterr().out
    assert "greedy set" in printed and f"critical layers {prof['layers']}" in printed


def test_ranking_options_score_what_the_selector_ranks_and_go_into_the_profile(smol_engine, toy_set):
    """With a profile's ranking options (a position prior, chunk sinks) a layer set scores what
    the qcfuse selector does with those layers and options; the profile keeps the options."""
    adapter = smol_engine.adapter
    q, passages, _ = QUESTIONS[0]
    prep = prepare_example(smol_engine, q, passages, AnchorConfig(), LAYERS)
    full = prep.ref
    for options in ({"position_prior": 2.0}, {"chunk_sinks": 3}):
        kl, _ = score_set(smol_engine, prep, [5, 8], 0.3, options)
        sel = get_selector("qcfuse").select(SelectionContext(adapter, prep.prompt, 0.3,
                                                             options={"critical_layers": [5, 8], **options}))
        logits = fused_prefill(adapter, prep.prompt, sel.rows, logits_last=1).logits[-1]
        assert kl == pytest.approx(M.kl_divergence(full, logits), rel=1e-4, abs=1e-7)
    plain = get_selector("qcfuse").select(SelectionContext(adapter, prep.prompt, 0.3, options={"critical_layers": [5, 8]}))
    steep = get_selector("qcfuse").select(SelectionContext(adapter, prep.prompt, 0.3,
                                                           options={"critical_layers": [5, 8], "position_prior": 2.0}))
    assert not torch.equal(plain.rows, steep.rows)  # the prior really re-ranks
    prof = profile_layers(smol_engine, str(toy_set), limit=1, ratio=0.3, top_k=2, layers=LAYERS,
                          options={"position_prior": 2.0})
    assert prof["options"] == {"position_prior": 2.0} and "--option position_prior=2.0" in prof["source"]
    assert prof["ranking"][0]["kl"] == pytest.approx(
        min(score_set(smol_engine, prep, [x], 0.3, {"position_prior": 2.0})[0] for x in LAYERS), rel=1e-4, abs=1e-7)
    with pytest.raises(ValueError, match="cannot come from a profile"):
        profile_layers(smol_engine, str(toy_set), limit=1, layers=LAYERS, options={"spread": 2})
    with pytest.raises(ValueError, match="position_prior must be"):
        profile_layers(smol_engine, str(toy_set), limit=1, layers=LAYERS, options={"position_prior": -1})


def _profiled(smol_engine, tmp_path, monkeypatch, options: dict):
    """An engine whose model has a user profile (layers [5, 8] and `options`), a prompt of
    QUESTIONS[0], and rows(method, **options): the selector's rows with explicit options."""
    from qcfuse_core.selection import profiles as critical_layers
    from qcfuse_core.engine.api import QCFuseEngine

    monkeypatch.setattr(critical_layers, "profile_dir", lambda: tmp_path)
    adapter = smol_engine.adapter
    (tmp_path / f"{adapter.fingerprint()}.json").write_text(json.dumps({"layers": [5, 8], "options": options}))
    eng = QCFuseEngine(adapter)
    q, passages, _ = QUESTIONS[0]
    prompt, _, _ = eng._steps.fuse_pieces(eng.frame.rag_pieces(q, passages))

    def rows(method="qcfuse", **opts):
        return get_selector(method).select(SelectionContext(adapter, prompt, 0.3, options=opts)).rows

    return eng, prompt, rows


def test_an_adaptive_budget_takes_a_profiles_options_less_the_fixed_only_ones(smol_engine, toy_set, tmp_path,
                                                                                  monkeypatch):
    """A profile with chunk sinks (a fixed budget's option): qcfuse at a fixed budget places
    them; qcfuse's adaptive budget, the adaptive method and its calibration take the profile's
    prior only (an adaptive budget refuses chunk sinks)."""
    from qcfuse_core.eval import calibration
    from qcfuse_core.selection import adaptive as adaptive_mod

    eng, prompt, rows = _profiled(smol_engine, tmp_path, monkeypatch, {"position_prior": 0.5, "chunk_sinks": 3})
    fixed = eng._steps.select(prompt, "qcfuse", 0.3).selection
    assert torch.equal(fixed.rows, rows(critical_layers=[5, 8], position_prior=0.5, chunk_sinks=3))
    assert not torch.equal(fixed.rows, rows(critical_layers=[5, 8], position_prior=0.5))
    heads = [s for s, _ in prompt.chunk_spans()]
    assert all(h in set(fixed.rows.tolist()) for h in heads)  # every chunk's first token recomputed
    assert eng._steps.selection_options("adaptive") == {"critical_layers": [5, 8], "position_prior": 0.5}
    assert eng._steps.selection_options("qcfuse", {"budget": "adaptive"}) == {
        "critical_layers": [5, 8], "position_prior": 0.5, "budget": "adaptive"}
    budget = eng._steps.select(prompt, "qcfuse", 0.3, {"budget": "adaptive"}).selection
    assert torch.equal(budget.rows, rows(critical_layers=[5, 8], position_prior=0.5, budget="adaptive"))
    cal = calibration.calibrate(eng, str(toy_set), shares=(0.3,))
    assert cal["critical_layers"] == [5, 8] and cal["options"] == {"position_prior": 0.5}
    monkeypatch.setattr(adaptive_mod, "lookup_calibration", lambda a: (cal, "test"))
    got = eng._steps.select(prompt, "adaptive", 0.3).selection
    assert got.details["position_prior"] == 0.5 and got.details["chunk_sinks"] == 0
    with pytest.raises(ValueError, match="fixed budget"):  # a caller's own sinks are still refused
        eng._steps.select(prompt, "qcfuse", 0.3, {"budget": "adaptive", "chunk_sinks": 3})


def test_engine_applies_a_profiles_options_with_its_layers_only(smol_engine, tmp_path, monkeypatch):
    """A user profile's options reach qcfuse (either budget) and adaptive when its layers are
    used; a caller's own option wins; explicit critical layers, layers from the engine's config
    and other methods do not take them; a profile with an option it may not carry is refused,
    naming it."""
    from qcfuse_core.selection import profiles as critical_layers
    from qcfuse_core.engine.api import QCFuseEngine

    monkeypatch.setattr(critical_layers, "profile_dir", lambda: tmp_path)
    adapter = smol_engine.adapter
    path = tmp_path / f"{adapter.fingerprint()}.json"
    path.write_text(json.dumps({"layers": [5, 8], "options": {"position_prior": 2.0}}))
    prof = critical_layers.resolve(adapter)
    assert prof.layers == [5, 8] and prof.options == {"position_prior": 2.0} and str(path) in prof.source
    assert critical_layers.lookup(adapter) == ([5, 8], prof.source)

    eng, prompt, rows = _profiled(smol_engine, tmp_path, monkeypatch, prof.options)
    got = eng._steps.select(prompt, "qcfuse", 0.3).selection
    assert got.details["position_prior"] == 2.0 and torch.equal(got.rows, rows(critical_layers=[5, 8], position_prior=2.0))
    assert not torch.equal(got.rows, rows(critical_layers=[5, 8]))
    own = eng._steps.select(prompt, "qcfuse", 0.3, {"position_prior": 0.0}).selection  # the caller's own setting wins
    assert own.details["position_prior"] == 0.0 and torch.equal(own.rows, rows(critical_layers=[5, 8]))
    explicit = eng._steps.select(prompt, "qcfuse", 0.3, {"critical_layers": [5, 8]}).selection
    assert explicit.details["position_prior"] == 0.0
    adaptive = eng._steps.select(prompt, "qcfuse", 0.3, {"budget": "adaptive"}).selection
    assert adaptive.details["position_prior"] == 2.0 and adaptive.details["budget_mode"] == "adaptive"
    assert torch.equal(adaptive.rows, rows(critical_layers=[5, 8], position_prior=2.0, budget="adaptive"))
    assert eng._steps.selection_options("qcfuse") == {"critical_layers": [5, 8], "position_prior": 2.0}
    assert eng._steps.selection_options("cacheblend") == {}
    # the adaptive method: its calibration must have counted on the same ranking
    from qcfuse_core.selection import adaptive as adaptive_mod
    cal = {"targets": {"0.1": 0.4, "0.3": 0.8}, "floor": 0.0, "ceiling": 0.5, "critical_layers": [8, 5],
           "options": {"position_prior": 2}}
    monkeypatch.setattr(adaptive_mod, "lookup_calibration", lambda a: (cal, "test"))
    got = eng._steps.select(prompt, "adaptive", 0.3).selection
    assert got.details["position_prior"] == 2.0 and got.details["target_mass"] == 0.8
    assert torch.equal(got.rows, rows(critical_layers=[5, 8], position_prior=2.0, budget="adaptive", target_mass=0.8,
                                      floor=0.0, ceiling=0.5))
    with pytest.raises(ValueError, match="calibrated with ranking options"):
        eng._steps.select(prompt, "adaptive", 0.3, {"position_prior": 1.0})
    with pytest.raises(ValueError, match="calibrated at critical layers"):
        eng._steps.select(prompt, "adaptive", 0.3, {"critical_layers": [5]})
    # layers from the engine's config, not the profile: no profile options, also when a call
    # passes options without layers
    from qcfuse_core import EngineConfig, QCFuseOptions
    configured = QCFuseEngine(adapter, config=EngineConfig(selection=QCFuseOptions(critical_layers=(5, 8))))
    for opts in (None, {"spread": 0}):
        sel = configured._steps.select(prompt, "qcfuse", 0.3, opts).selection
        assert sel.details["position_prior"] == 0.0 and sel.details["layers_source"] == "option"
        assert torch.equal(sel.rows, rows(critical_layers=[5, 8]))

    path.write_text(json.dumps({"layers": [5, 8], "options": {"deviation_pool": 2}}))
    with pytest.raises(ValueError, match=r"options \['deviation_pool'\] cannot come from a profile"):
        critical_layers.resolve(adapter)
    with pytest.raises(ValueError, match="cannot come from a profile"):
        critical_layers.save_profile({"layers": [5], "options": {"spread": 1}}, tmp_path / "p.json", adapter)
