"""The probe replayed from a captured CUDA graph equals the eager probe (CUDA only).

Skips without CUDA. Covers: equality (fp32 atol 1e-4, bf16 atol 3e-2 on q/k of magnitude
~1-5), two requests of different shapes in one bucket reusing one graph, a new bucket
capturing a second graph, results that survive the next replay (copies, not the graph's
buffers), and the selector reporting that the graph ran.
"""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.selection import probe as P
from qcfuse_core.selection.probe import gather_context, run_probe
from qcfuse_core.model.testing import tiny_model
from tests.qc_fixtures import prompt_exact

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(m, lens, seed):
    prompt, _ = prompt_exact(m, lens=lens, seed=seed)
    seg, start = prompt.segments[-1], prompt.starts[-1]
    pick = lambda s: torch.stack([torch.arange(0, len(s), 3)] * m.num_layers)  # noqa: E731
    return seg.token_ids, torch.arange(start, start + len(seg)), gather_context(prompt, m.num_layers, pick)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_graph_replay_equals_eager(dtype, atol):
    m = tiny_model("llama", dtype=dtype)
    m.model.to("cuda")
    P._CACHES.pop(m, None)
    runs = []
    for lens, seed in (([6, 40, 2, 30, 20, 7], 0), ([5, 33, 2, 41, 18, 9], 1), ([6, 300, 2, 400, 200, 20], 2)):
        ids, pos, ctx = _inputs(m, lens, seed)
        eager = run_probe(m, ids, pos, ctx, keep=[0, 2], graphs=False, hidden=True)
        graph = run_probe(m, ids, pos, ctx, keep=[0, 2], graphs=True, hidden=True)
        assert graph.graphed and not eager.graphed
        for l in (0, 2):
            assert graph.q[l].shape == eager.q[l].shape
            assert torch.allclose(graph.q[l].float(), eager.q[l].float(), atol=atol)
            assert torch.allclose(graph.k[l].float(), eager.k[l].float(), atol=atol)
        assert torch.allclose(graph.hidden.float(), eager.hidden.float(), atol=atol * 10)
        runs.append((graph, eager))
    # the first two requests share a bucket (rows <= 16, context <= 256); the third needs another
    assert len(P._graph_cache(m).graphs) == 2
    first_graph, first_eager = runs[0]
    assert torch.allclose(first_graph.q[2].float(), first_eager.q[2].float(), atol=atol)  # not overwritten


def test_graph_without_hidden_stops_at_the_last_qk():
    """The selection's probe (no hidden state) is its own graph and gives eager's Q and K."""
    m = tiny_model("llama", dtype=torch.bfloat16)
    m.model.to("cuda")
    P._CACHES.pop(m, None)
    ids, pos, ctx = _inputs(m, [6, 40, 2, 30, 20, 7], 0)
    eager = run_probe(m, ids, pos, ctx, keep=[0, 2], graphs=False)
    graph = run_probe(m, ids, pos, ctx, keep=[0, 2], graphs=True)
    assert graph.graphed and graph.hidden is None and eager.hidden is None
    for l in (0, 2):
        assert torch.allclose(graph.q[l].float(), eager.q[l].float(), atol=3e-2)
        assert torch.allclose(graph.k[l].float(), eager.k[l].float(), atol=3e-2)


def test_qcfuse_selector_uses_the_graph_on_cuda():
    from qcfuse_core.selection.base import SelectionContext, get_selector

    from tests.qc_fixtures import prompt_alone

    m = tiny_model("llama")
    m.model.to("cuda")
    prompt = prompt_alone(m)
    opts = {"critical_layers": (1, 2)}
    sel = get_selector("qcfuse").select(SelectionContext(m, prompt, 0.3, options=opts))
    assert sel.details["probe_graphed"] is True
