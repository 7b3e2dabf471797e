"""The query probe against dense references (tiny random models, fp32).

With every context token as an anchor and exact in-context caches, the probe is an ordinary
prefill restricted to the suffix rows: its logits must match HF's (atol 1e-4, logits ~1-10),
and the attention mass at a layer must match a dense softmax over the full prefill's keys
(atol 1e-6, rtol 1e-3 as in the kernel tests: the mass kernel sums in another order).
"""

import pytest
import torch

from qcfuse_core.selection.probe import LayerContext, context_keys, gather_context, query_mass, run_probe
from qcfuse_core.model.testing import tiny_model
from tests.qc_fixtures import prompt_exact

KINDS_NO_GLUE = ["prefix", "chunk", "chunk", "chunk", "suffix"]
LENS_NO_GLUE = [6, 20, 24, 16, 7]


def _suffix(prompt):
    seg, start = prompt.segments[-1], prompt.starts[-1]
    return seg.token_ids, torch.arange(start, start + len(seg))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_probe_with_all_tokens_equals_full_prefill(arch):
    m = tiny_model(arch)
    prompt, _ = prompt_exact(m, LENS_NO_GLUE, KINDS_NO_GLUE)  # glue has no cache, so the probe cannot see it
    ref, _ = m.hf_forward(prompt.token_ids, keep=None)  # (T, vocab)
    ids, pos = _suffix(prompt)
    L = m.num_layers
    probe = run_probe(m, ids, pos, gather_context(prompt, L, None), keep=[L - 1], hidden=True)
    got = m.logits(probe.hidden)
    err = (got - ref[pos]).abs().max().item()
    assert err < 1e-4, f"max abs err {err:.3e}"
    assert probe.context_sizes == [prompt.num_tokens - len(ids)] * L


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_query_mass_matches_dense_softmax(arch):
    m = tiny_model(arch)
    prompt, cache = prompt_exact(m)
    ids, pos = _suffix(prompt)
    T, S = prompt.num_tokens, len(ids)
    glue = prompt.mask("text")
    layer = 1
    probe = run_probe(m, ids, pos, gather_context(prompt, layer + 1, None), keep=[layer])
    k_ctx, ctx_pos = context_keys(m, prompt, layer)
    mass = query_mass(probe.q[layer], k_ctx, probe.k[layer], m.scale)  # (N,)
    # dense reference: the full prefill's rotated context keys (glue dropped), the probe's query keys
    keep = ~glue
    ctx_mask = keep & ~prompt.mask("suffix")
    keys = torch.cat([cache.k[layer, :T][ctx_mask], probe.k[layer]])  # (T - 2, Hkv, D): exact context ; probed query
    kf = keys.repeat_interleave(m.shape.num_heads // m.shape.num_kv_heads, dim=1).transpose(0, 1)
    logits = torch.matmul(probe.q[layer].transpose(0, 1), kf.transpose(1, 2)) * m.scale  # (H, S, T-2)
    key_pos = torch.arange(T)[keep]
    logits = logits.masked_fill(~(key_pos[None, :] <= pos[:, None])[None], float("-inf"))
    probs = logits.softmax(-1)  # (H, S, keys)
    dense = probs.mean(dim=(0, 1))[: ctx_pos.numel()]
    assert torch.equal(ctx_pos, key_pos[: ctx_pos.numel()])
    err = (mass - dense).abs().max().item()
    assert torch.allclose(mass, dense, atol=1e-6, rtol=1e-3), f"max abs err {err:.3e}"
    assert abs(float(mass.sum()) - float(dense.sum())) < 1e-5
    # the last R query rows only (each still sees every query key before it)
    for R in (1, 3):
        got = query_mass(probe.q[layer], k_ctx, probe.k[layer], m.scale, last=R)
        want = probs[:, S - R :].mean(dim=(0, 1))[: ctx_pos.numel()]
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-3), f"last={R}: {(got - want).abs().max():.3e}"
        assert not torch.allclose(got, mass, atol=1e-4)  # a different average, not the same one
    for every in (0, S, S + 5):  # 0 or more rows than the query has: all of them
        assert torch.equal(query_mass(probe.q[layer], k_ctx, probe.k[layer], m.scale, last=every), mass)
    with pytest.raises(ValueError, match="last"):
        query_mass(probe.q[layer], k_ctx, probe.k[layer], m.scale, last=-1)


def test_probe_with_anchor_subset_runs_and_is_not_full():
    m = tiny_model("llama")
    prompt, _ = prompt_exact(m)
    ids, pos = _suffix(prompt)
    pick = lambda seg: torch.arange(4).expand(m.num_layers, 4)  # noqa: E731  first 4 tokens only
    probe = run_probe(m, ids, pos, gather_context(prompt, m.num_layers, pick), keep=[0, 2])
    assert set(probe.q) == {0, 2} and probe.q[2].shape == (len(ids), m.shape.num_heads, m.shape.head_dim)
    assert probe.context_sizes == [6 + 3 * 4] * 3  # whole prefix + 4 anchors per chunk


def test_probe_rejects_context_after_the_query():
    m = tiny_model("llama")
    k = torch.zeros(3, m.shape.num_kv_heads, m.shape.head_dim)
    ctx = [LayerContext(k, k, torch.tensor([0, 1, 9]))] * m.num_layers
    with pytest.raises(ValueError, match="precede"):
        run_probe(m, torch.tensor([1, 2]), torch.tensor([5, 6]), ctx, keep=[0])
    with pytest.raises(ValueError, match="probe layers"):
        run_probe(m, torch.tensor([1, 2]), torch.tensor([5, 6]), ctx, keep=[7])


def _anchor_probe_inputs(m, seed=0):
    prompt, _ = prompt_exact(m, seed=seed)
    ids, pos = _suffix(prompt)
    pick = lambda seg: torch.stack([torch.randperm(len(seg), generator=torch.Generator().manual_seed(l))[:5].sort().values  # noqa: E731
                                    for l in range(m.num_layers)])
    return ids, pos, gather_context(prompt, m.num_layers, pick)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_layout_equals_unpadded(arch):
    """The CUDA-graph bucket layout (rows to 16, context to 256, padding at a hidden position)
    gives the same q/k/hidden as the exact shapes: fp32, atol 1e-5."""
    m = tiny_model(arch)
    ids, pos, ctx = _anchor_probe_inputs(m)
    assert len(ids) % 16 and ctx.pos.shape[1] % 256  # really padded
    a = run_probe(m, ids, pos, ctx, keep=[0, 2], hidden=True)
    b = run_probe(m, ids, pos, ctx, keep=[0, 2], pad=True, hidden=True)
    assert b.q[2].shape == a.q[2].shape and b.hidden.shape == a.hidden.shape
    for l in (0, 2):
        assert torch.allclose(a.q[l], b.q[l], atol=1e-5) and torch.allclose(a.k[l], b.k[l], atol=1e-5)
    assert torch.allclose(a.hidden, b.hidden, atol=1e-5)
    assert not a.graphed and a.elapsed_ms > 0 and len(a.layer_ms) == 3


def test_per_layer_context_lists_stack_and_must_agree_in_size():
    m = tiny_model("llama")
    ids, pos, ctx = _anchor_probe_inputs(m)
    as_list = [ctx[l] for l in range(len(ctx))]
    a, b = run_probe(m, ids, pos, ctx, keep=[1]), run_probe(m, ids, pos, as_list, keep=[1])
    assert torch.equal(a.q[1], b.q[1])
    ragged = [as_list[0], LayerContext(as_list[1].k_pre[:-1], as_list[1].v[:-1], as_list[1].pos[:-1])]
    with pytest.raises(ValueError, match="same number"):
        run_probe(m, ids, pos, ragged, keep=[1])
    with pytest.raises(ValueError, match="context covers"):
        run_probe(m, ids, pos, as_list[:1], keep=[1])


def test_graphs_need_cuda():
    m = tiny_model("llama")
    ids, pos, ctx = _anchor_probe_inputs(m)
    with pytest.raises(ValueError, match="CUDA"):
        run_probe(m, ids, pos, ctx, keep=[1], graphs=True)


def test_probe_stops_at_the_last_layers_qk_unless_hidden_is_asked():
    """A selection needs the kept layers' Q and K only: by default the last layer stops after
    them (no attention, no MLP) and gives the same Q and K as a run that goes on."""
    m = tiny_model("llama")
    prompt, _ = prompt_exact(m, LENS_NO_GLUE, KINDS_NO_GLUE)
    ids, pos = _suffix(prompt)
    ctx = gather_context(prompt, m.num_layers, None)
    full = run_probe(m, ids, pos, ctx, keep=[0, 2], hidden=True)
    short = run_probe(m, ids, pos, ctx, keep=[0, 2])
    assert short.hidden is None and full.hidden is not None
    for layer in (0, 2):
        assert torch.equal(short.q[layer], full.q[layer]) and torch.equal(short.k[layer], full.k[layer])
