"""The engine end to end on each device: text in, tokens out, through the tiered store.

A tiny random Llama with a byte-level tokenizer runs the text-level API (RAG pieces, chunk
ingestion, anchors, sidecars, the prefetcher, the probe - a CUDA graph on a GPU -, fusion,
decoding). Streaming the chunks' layers from the store must give the same tokens and rows
as fusing in-memory caches, and recomputing every row must give full prefill's tokens. The
CUDA case skips without a GPU; the CPU case runs the same code everywhere.
"""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.store import kv_dir, open_store
from qcfuse_core.model.testing import tiny_model

DOCS = [
    "The Zephyr Institute is a marine research station in Port Halden, founded in 1987 by Ada Ferreira.",
    "Cape Wrayth lighthouse stands on the northern tip of Veloria; its stone tower is thirty-two metres tall.",
    "Halden Rovers is the football club of Port Halden. It was founded in 1911 and plays at Quayside Park.",
]
Q = "How tall is the Cape Wrayth lighthouse?"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.fixture(params=DEVICES)
def engines(request, tmp_path):
    m = tiny_model("llama", tokenizer=True)
    m.model.to(request.param)
    cuda = request.param == "cuda"
    tiered = QCFuseEngine(m, store=open_store(kv_dir(tmp_path), memory_bytes=64 << 20, use_cuda=cuda))
    for i, d in enumerate(DOCS):
        tiered.build_chunks([d], [f"n{i}"])
    yield QCFuseEngine(m), tiered
    tiered.caches.store.close()


@pytest.mark.parametrize("method", ["qcfuse", "cacheblend", "epic", "naive"])
def test_streamed_store_answers_like_in_memory(engines, method):
    mem, tiered = engines
    a = mem.answer(Q, DOCS, method=method, ratio=0.3, max_new_tokens=8, stop=[])
    b = tiered.answer(Q, DOCS, method=method, ratio=0.3, max_new_tokens=8, stop=[])
    assert b.cache_hits == 3 and b.cache_misses == 0
    assert b.token_ids == a.token_ids and len(a.token_ids) > 0
    assert b.selection.rows.tolist() == a.selection.rows.tolist()
    if method == "qcfuse":
        graphed = mem.adapter.device.type == "cuda"
        assert a.selection.details["probe_graphed"] is graphed and b.selection.details["probe_graphed"] is graphed


def test_every_row_recomputed_answers_like_full_prefill(engines):
    mem, tiered = engines
    full = mem.answer(Q, DOCS, method="full", max_new_tokens=8, stop=[])
    for eng in (mem, tiered):
        r = eng.answer(Q, DOCS, method="qcfuse", ratio=1.0, max_new_tokens=8, stop=[])
        assert r.recomputed_tokens == r.context_tokens
        assert r.token_ids == full.token_ids


def _qcfuse_streamed_like_in_memory(engines, options: dict):
    """qcfuse@0.3 with selection `options` on both engines; streamed must answer like in memory
    (same tokens, same rows). -> the in-memory answer."""
    from qcfuse_core.eval.hooks import internals

    mem, tiered = engines
    for eng in (mem, tiered):
        internals(eng).use(selection=options, rates=eng._steps.rates)
    a = mem.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=8, stop=[])
    b = tiered.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=8, stop=[])
    assert b.token_ids == a.token_ids and len(a.token_ids) > 0
    assert b.selection.rows.tolist() == a.selection.rows.tolist()
    return a


def test_deviation_pool_streamed_answers_like_in_memory(engines):
    """qcfuse with the layer-1 deviation re-ranking narrows its rows inside the pipelined
    prefill; streamed from the store it must pick the same rows and tokens as in memory."""
    mem, _ = engines
    plain = mem.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=8, stop=[])
    a = _qcfuse_streamed_like_in_memory(engines, {"deviation_pool": 2})
    d = a.selection.details
    assert d["deviation_pool"] == 2 and d["pool"].numel() == 2 * d["budget"]
    assert d["positions"].numel() == d["budget"] and set(d["positions"].tolist()) <= set(d["pool"].tolist())
    assert a.recomputed_tokens == plain.recomputed_tokens  # the final rows, not the pool
    assert a.selection.rows.tolist() != plain.selection.rows.tolist()


def test_position_prior_ranks_mass_times_prior_on_the_device(engines):
    """position_prior re-weights the ranking where the mass lives (on a GPU, on the GPU): the
    chosen positions equal a host top-k of the returned mass x the prior, and streamed ==
    in memory."""
    from qcfuse_core.selection.scoring import top_budget
    from qcfuse_core.selection.selectors import chunk_position_prior

    mem, _ = engines
    a = _qcfuse_streamed_like_in_memory(engines, {"position_prior": 0.8})
    prompt, _, _ = mem._steps.fuse_pieces(mem.frame.rag_pieces(Q, DOCS), caches=False)  # the same layout, tokens only
    assert prompt.num_tokens == a.prompt_tokens
    mass = torch.zeros(prompt.num_tokens)
    mass[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = a.selection.scores.float().cpu()
    cand = torch.nonzero(prompt.mask("chunk")).flatten()
    want = top_budget(cand, (mass * chunk_position_prior(prompt, 0.8))[cand], a.selection.details["budget"])
    assert a.selection.details["positions"].tolist() == want.tolist()
    assert want.tolist() != top_budget(cand, mass[cand], a.selection.details["budget"]).tolist()  # the prior mattered
    assert a.selection.details["position_prior"] == 0.8
