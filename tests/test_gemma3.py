"""The packaged Gemma-3-270M: converted once from its chunked GGUF, exact through fused
prefill across its sliding window, answering offline by name (`--model gemma3-270m`).

Slow: the first run on a machine assembles and converts the GGUF into the cache dir (a few
minutes on a small CPU); later runs load the converted folder.
"""

from __future__ import annotations

import json

import pytest
import torch

from qcfuse_core.selection import profiles as critical_layers
from qcfuse_core.cli.commands import main
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.fusion import fused_prefill
from qcfuse_core.model.adapter import MODELS, load_model, packaged_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m", dtype="fp32")


def test_conversion_leaves_a_plain_safetensors_folder(gemma):
    folder = packaged_model_dir("gemma3-270m")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "quantization_config" not in config
    assert list(folder.glob("*.safetensors"))
    assert not list(folder.parent.glob(".gguf-*")), "the assembled GGUF is removed after conversion"
    assert not MODELS["gemma3-270m"].instruct and not getattr(gemma.tokenizer, "chat_template", None)


def test_gemma_shape_windows_and_profile(gemma):
    assert gemma.arch == "gemma3" and gemma.num_layers == 18
    assert gemma.windows == ([512] * 5 + [None]) * 3
    assert gemma.scale == pytest.approx(256 ** -0.5)  # query_pre_attn_scalar
    prof = critical_layers.resolve(gemma)
    assert prof.source.startswith("packaged profile gemma-3-270m"), prof.source
    # profiled with a position prior, the query's mass at a sliding layer reaches only the last
    # 512 positions: the profile keeps the three full-attention layers, and its ranking options
    assert sorted(prof.layers) == [5, 11, 17] and all(gemma.windows[x] is None for x in prof.layers)
    assert prof.options == {"position_prior": 2, "prior_depth": 64}


def test_full_recompute_across_the_window_equals_hf(gemma):
    """A RAG prompt longer than the 512-token window: every row recomputed == HF's forward."""
    eng = QCFuseEngine(gemma)
    passages = [
        " ".join(f"The lighthouse keeper of island {i} logged {i * 7} storms in the year {1900 + i}." for i in range(k, k + 12))
        for k in (0, 12, 24)
    ]
    prompt, _, _ = eng._steps.fuse_pieces(eng.frame.rag_pieces("How many storms did the keeper of island 30 log?", passages))
    assert prompt.num_tokens > 600
    ref, _ = gemma.hf_forward(prompt.token_ids, keep=8)
    out = fused_prefill(gemma, prompt, torch.arange(prompt.num_tokens), logits_last=8)
    err = (out.logits - ref).abs().max().item()
    assert err <= 1e-3, f"max abs err {err:.3e}"  # logits of order 10-30; fp32 summation order


def test_qcfuse_on_gemma_ranks_with_the_profiles_options_at_full_attention_layers(gemma):
    """engine.select on the packaged model: the profile's layers and prior (with its depth)
    reach the selector, and the rows are those of the selector run with them explicitly."""
    from qcfuse_core.selection.base import SelectionContext, get_selector

    eng = QCFuseEngine(gemma)
    passages = [" ".join(f"Harbour {i} shipped {i * 3} crates of tea in {1800 + i}." for i in range(k, k + 30))
                for k in (0, 30, 60)]
    prompt, _, _ = eng._steps.fuse_pieces(eng.frame.rag_pieces("How many crates did harbour 75 ship?", passages))
    assert prompt.num_tokens > 1000  # the first chunks lie outside the last token's window
    got = eng._steps.select(prompt, "qcfuse", 0.3).selection
    assert got.details["position_prior"] == 2 and got.details["prior_depth"] == 64
    assert sorted(got.details["critical_layers"]) == [5, 11, 17]
    want = get_selector("qcfuse").select(SelectionContext(gemma, prompt, 0.3, options={
        "critical_layers": eng.builder.critical_layers, "position_prior": 2, "prior_depth": 64}))
    assert torch.equal(got.rows, want.rows)
    steep = get_selector("qcfuse").select(SelectionContext(gemma, prompt, 0.3, options={
        "critical_layers": eng.builder.critical_layers, "position_prior": 2}))
    assert not torch.equal(got.rows, steep.rows)  # chunks of ~340 tokens: the depth re-ranks
    first = prompt.chunk_spans()[0]
    assert int(((got.rows >= first[0]) & (got.rows < first[1])).sum()) > 0  # rows outside the window too


def test_packaged_adaptive_calibration_matches_the_profile(gemma, monkeypatch, tmp_path):
    """The shipped adaptive-budget calibration was counted on the shipped profile's ranking (its
    layers and prior), so `adaptive` serves on the packaged model with it."""
    from qcfuse_core.selection import adaptive

    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path))  # no user calibration (the model is loaded)
    cal, source = adaptive.lookup_calibration(gemma)
    prof = critical_layers.resolve(gemma)
    assert source.startswith("packaged calibration gemma-3-270m"), source
    assert sorted(cal["critical_layers"]) == sorted(prof.layers)
    assert cal["options"] == prof.options == {"position_prior": 2, "prior_depth": 64}
    eng = QCFuseEngine(gemma)
    passages = [" ".join(f"Mill {i} ground {i * 5} sacks of rye in {1700 + i}." for i in range(k, k + 20)) for k in (0, 20)]
    prompt, _, _ = eng._steps.fuse_pieces(eng.frame.rag_pieces("How many sacks did mill 25 grind?", passages))
    got = eng._steps.select(prompt, "adaptive", 0.3).selection
    assert got.details["position_prior"] == 2 and got.details["prior_depth"] == 64
    assert got.details["target_mass"] == adaptive.target_for(cal, 0.3)
    assert got.details["budget_mode"] == "adaptive" and got.rows.numel() > 0


def test_plain_prompt_frame_for_the_base_model(gemma):
    """No chat template: BOS, the system line, the documents, the question, "Answer:"."""
    eng = QCFuseEngine(gemma)
    prompt, _, _ = eng._steps.fuse_pieces(eng.frame.rag_pieces("Who?", ["A doc."]), caches=False)
    ids = prompt.token_ids.tolist()
    assert ids[0] == gemma.tokenizer.bos_token_id and ids.count(gemma.tokenizer.bos_token_id) == 1
    text = gemma.tokenizer.decode(ids)
    assert text.startswith("<bos>" + eng.config.frame.system_prompt + "\n\n") and text.endswith("\nAnswer:")
    assert "<start_of_turn>" not in text


def test_ask_by_name_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The Glimmer Bridge in Oskarvik was opened in 1932 and is painted bright orange.\n")
    (docs / "b.txt").write_text("Oskarvik's bakery sells cardamom buns every morning from six o'clock.\n")
    store = str(tmp_path / "s")
    assert main(["ingest", str(docs), "--store", store, "--model", "gemma3-270m"]) == 0
    capsys.readouterr()
    assert main(["ask", "When was the Glimmer Bridge opened?", "--store", store, "--model", "gemma3-270m",
                 "--json", "--top-k", "2", "--max-new-tokens", "6"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["answer"].strip() and r["cache_hits"] == 2 and r["cache_misses"] == 0
