"""Fused prefill on CUDA through the Triton kernels equals HF transformers' forward (fp32).

Skips without CUDA; run on the GPU machine with TRITON_INTERPRET=0.
"""

from __future__ import annotations

import pytest
import torch

import qcfuse_kernels as K
from qcfuse_core.model.fusion import FusedPrompt, KVCache, Segment, fused_prefill
from qcfuse_core.model.testing import TINY_CONFIGS, tiny_model
from qcfuse_core.types import ChunkKey, KVChunk

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(
    not torch.cuda.is_available() or K.backend() != "triton",
    reason="needs CUDA and compiled Triton (TRITON_INTERPRET=0)",
)]


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_sparse_rows_over_exact_caches_equal_hf_on_cuda(arch):
    m = tiny_model(arch)
    m.model.to("cuda")
    g = torch.Generator().manual_seed(0)
    lens, kinds = [9, 200, 3, 310, 150, 12], ["prefix", "chunk", "text", "chunk", "chunk", "suffix"]
    parts = [torch.randint(0, m.shape.vocab_size, (n,), generator=g) for n in lens]
    whole = FusedPrompt([Segment("suffix", torch.cat(parts))])
    T = whole.num_tokens
    cap = KVCache(m, T)
    k_pre = fused_prefill(m, whole, torch.arange(T), kv_out=cap, capture_pre_rope=True).k_pre
    segs, pos = [], 0
    for ids, kind in zip(parts, kinds):
        n = len(ids)
        chunk = None
        if kind in ("prefix", "chunk"):
            chunk = KVChunk(ChunkKey.for_tokens("0" * 16, ids), ids, k_pre[:, pos:pos + n].clone(), cap.v[:, pos:pos + n].clone())
        segs.append(Segment(kind, ids, chunk))
        pos += n
    prompt = FusedPrompt(segs)
    ref, _ = m.hf_forward(prompt.token_ids)
    for share in (0.0, 0.15, 0.3):
        pick = (torch.rand(T, generator=g) < share) | prompt.uncached_mask()
        rows = torch.nonzero(pick).flatten()
        out = fused_prefill(m, prompt, rows)
        err = (out.logits - ref).abs().max().item()
        assert err < 1e-4, f"{arch} share={share}: max abs err {err:.3e}"
