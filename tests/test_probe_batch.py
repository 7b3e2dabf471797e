"""Several requests probed in one pass (`selection.probe.run_probe_batch`, which `run_probe`
runs as a batch of one): each request's Q/K at its kept layers is what it gets probed alone,
and no request sees another's context. Tiny random models, fp32, CPU; on the PyTorch
references (fast tier) and through Triton's interpreter (slow tier: WHOLE_MODEL_BACKENDS).

Tolerances: a matrix product over the rows of several requests rounds differently from one
over a request's rows alone (the BLAS picks kernels by shape), so batched results agree to
float tolerance (1e-5)."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.model.testing import tiny_model
from qcfuse_core.selection.probe import ProbeItem, gather_context, run_probe, run_probe_batch
from tests.qc_fixtures import WHOLE_MODEL_BACKENDS, prompt_alone

by_backend = pytest.mark.parametrize("backend", WHOLE_MODEL_BACKENDS)

# six prompts of different shapes: (lengths, kinds, seed)
SHAPES = [
    ([6, 20, 2, 24, 16, 7], ["prefix", "chunk", "text", "chunk", "chunk", "suffix"], 0),
    ([6, 12, 2, 9, 5], ["prefix", "chunk", "text", "chunk", "suffix"], 1),
    ([4, 30, 2, 18, 2, 22, 9], ["prefix", "chunk", "text", "chunk", "text", "chunk", "suffix"], 2),
    ([6, 8, 3], ["prefix", "chunk", "suffix"], 3),
    ([6, 16, 2, 16, 2, 16, 2, 16, 11], ["prefix"] + ["chunk", "text"] * 3 + ["chunk", "suffix"], 4),
    ([5, 25, 2, 7, 4], ["prefix", "chunk", "text", "chunk", "suffix"], 5),
]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return tiny_model(request.param)


def _prompts(m):
    return [prompt_alone(m, lens, kinds, seed) for lens, kinds, seed in SHAPES]


def _suffix(prompt):
    seg, start = prompt.segments[-1], prompt.starts[-1]
    return seg.token_ids, torch.arange(start, start + len(seg))


@by_backend
def test_probe_batch_equals_each_alone(model, backend):
    """Q/K at the kept layers per request, with requests probing to different depths and
    through the padded layout a CUDA graph replays."""
    prompts = _prompts(model)
    keeps = [[1], [0, 2], [2], [0], [1, 2], [1]]
    items = []
    for p, keep in zip(prompts, keeps):
        ids, pos = _suffix(p)
        items.append(ProbeItem(ids, pos, gather_context(p, max(keep) + 1, None), keep))
    for pad in (False, True):
        got = run_probe_batch(model, items, pad=pad)
        for it, g in zip(items, got):
            want = run_probe(model, it.ids, it.positions, it.context, keep=it.keep, pad=pad)
            assert sorted(g.q) == sorted(want.q) == sorted(it.keep)
            assert g.batch == len(items)
            for layer in it.keep:
                torch.testing.assert_close(g.q[layer], want.q[layer], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(g.k[layer], want.k[layer], atol=1e-5, rtol=1e-5)


@by_backend
def test_probe_batch_keeps_requests_apart(model, backend):
    """Garbage in one request's context changes nothing of another's probe."""
    prompts = _prompts(model)[:3]
    items = [ProbeItem(*_suffix(p), gather_context(p, 2, None), [1]) for p in prompts]
    base = run_probe_batch(model, items)
    ctx = items[0].context
    noisy = type(ctx)(torch.randn_like(ctx.k_pre) * 100, torch.randn_like(ctx.v) * 100, ctx.pos)
    got = run_probe_batch(model, [ProbeItem(items[0].ids, items[0].positions, noisy, [1]), *items[1:]])
    assert not torch.allclose(got[0].q[1], base[0].q[1])  # the noise reached request 0 (layer 0's attention)
    for b in (1, 2):
        torch.testing.assert_close(got[b].q[1], base[b].q[1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[b].k[1], base[b].k[1], atol=1e-6, rtol=1e-6)
