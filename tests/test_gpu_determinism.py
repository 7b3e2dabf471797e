"""Same input, same answer on a GPU (docs/determinism.md): the Llama-3.1-8B shape with random
weights (nearly flat logits expose any arithmetic that is not repeatable), bf16.

- ingestion: 16 chunks of mixed lengths, alone and in one batch: the same bits;
- repeats: requests of 4 x 512-token chunks drawn from a shared pool, run twice one after
  another through `engine.answer` (full prefill and qcfuse@0.15): identical tokens and
  first-token logits;
- the deterministic mode: 8 of those prompts decoded together in blocks equal each alone.

The figures for docs/benchmarks.md come from `python -m qcfuse_core.eval.determinism` on the
full workload (24 requests of 10 x 1024 tokens); this test runs a smaller one of the same code.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200 run of benchmarks/gpu.sh)"),
]


@pytest.fixture(scope="module")
def figures():
    from qcfuse_core.eval.determinism import run
    from qcfuse_core.model.testing import shaped_model

    adapter = shaped_model("llama-3.1-8b", dtype=torch.bfloat16, device="cuda", tokenizer=True)
    out = run(adapter, requests=8, chunks=4, pool=12, chunk_tokens=512, max_new_tokens=16, batch=8,
              methods=["full", "qcfuse"], ratio=0.15)
    print(out)
    return out


def test_ingestion_is_batch_invariant_on_the_gpu(figures):
    ing = figures["ingestion"]
    assert ing["identical"] == ing["chunks"] == 16


@pytest.mark.parametrize("method", ["full", "qcfuse"])
def test_requests_repeat_bit_for_bit_on_the_gpu(figures, method):
    rep = figures["repeats"][method]
    assert rep["identical_first_logits"] == rep["requests"], rep
    assert rep["identical_answers"] == rep["requests"], rep


def test_deterministic_batched_decode_equals_alone_on_the_gpu(figures):
    det = figures["deterministic"]
    assert det["identical_batched_vs_alone"] == det["batch"] == 8, det
