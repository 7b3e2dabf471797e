"""Several requests fused at once (issue: batched probes, ragged fused prefill): each request
of a batch gets what it gets alone. Tiny random models, fp32, CPU; the ragged prefill runs
through the Triton interpreter (`kernels` marker), so its one sparse-attention launch over
all requests is the kernel's.

Tolerances: a matrix product over the rows of several requests rounds differently from one
over a request's rows alone (the BLAS picks kernels by shape), so batched results agree to
float tolerance (logits ~1-10: 1e-5 absolute); with `exact` (the engine's deterministic
mode) they are the same bits."""

from __future__ import annotations

import pytest
import torch

import qcfuse_kernels as K
from qcfuse_core.model.fusion import FusedPrompt, FuseItem, KVCache, Segment, fused_prefill, fused_prefill_batch
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.selection import SelectionContext, get_selector
from qcfuse_core.selection.probe import ProbeItem, gather_context, run_probe, run_probe_batch
from qcfuse_core.selection.selectors import select_batch
from tests.qc_fixtures import WHOLE_MODEL_BACKENDS, engine_config, hold_worker, prompt_alone

# The batched probe and the ragged prefill run on the PyTorch references (fast tier) and through
# Triton's interpreter (slow tier: WHOLE_MODEL_BACKENDS); the engine-level tests below decode
# whole answers on the references.
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
OPTS = {"critical_layers": [1]}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return tiny_model(request.param)


def _prompts(m):
    return [prompt_alone(m, lens, kinds, seed) for lens, kinds, seed in SHAPES]


def _ctx(m, prompt, ratio=0.3, opts=OPTS):
    return SelectionContext(m, prompt, ratio, options=dict(opts))


def _suffix(prompt):
    seg, start = prompt.segments[-1], prompt.starts[-1]
    return seg.token_ids, torch.arange(start, start + len(seg))


# ------------------------------------------------------------------ batched probe


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


@by_backend
@pytest.mark.parametrize("method", ["qcfuse", "qcall"])
def test_select_batch_equals_select_alone(model, backend, method):
    """Scores and row sets of a batch of probing selections (mixed ratios) as alone; with
    exact, the same bits."""
    prompts = _prompts(model)
    ratios = [0.1, 0.3, 0.5, 0.15, 0.2, 0.4]
    sel = get_selector(method)
    alone = [sel.select(_ctx(model, p, r)) for p, r in zip(prompts, ratios)]
    for exact in (False, True):
        got = select_batch([(sel, _ctx(model, p, r)) for p, r in zip(prompts, ratios)], exact=exact)
        for g, w in zip(got, alone):
            assert not isinstance(g, Exception), g
            assert torch.equal(g.rows, w.rows)
            assert g.details["probe_batch"] == (1 if exact else len(prompts))
            if exact:
                assert torch.equal(g.scores, w.scores)
            else:
                torch.testing.assert_close(g.scores, w.scores, atol=1e-6, rtol=1e-5)


@by_backend
def test_select_batch_mixed_methods_and_failures(model, backend):
    """Probing and non-probing selectors in one batch; a request whose selection raises
    gets its error, the others their selections."""
    prompts = _prompts(model)
    jobs = [
        (get_selector("qcfuse"), _ctx(model, prompts[0])),
        (get_selector("naive"), _ctx(model, prompts[1])),
        (get_selector("qcfuse"), _ctx(model, prompts[2], opts={"critical_layers": [7]})),  # no such layer
        (get_selector("cacheblend"), _ctx(model, prompts[3])),
        (get_selector("qclast"), _ctx(model, prompts[4])),
    ]
    got = select_batch(jobs)
    assert isinstance(got[2], ValueError)
    for i in (0, 1, 3, 4):
        selector, ctx = jobs[i]
        want = selector.select(_ctx(model, ctx.prompt, ctx.ratio, ctx.options))
        assert torch.equal(got[i].rows, want.rows), i


# ------------------------------------------------------------------ ragged fused prefill


def _uncached(prompt: FusedPrompt) -> FusedPrompt:
    """The prompt's tokens with no caches (what full prefill fuses)."""
    return FusedPrompt([Segment(s.kind, s.token_ids) for s in prompt.segments])


def _items(m, prompts) -> list[FuseItem]:
    """Six requests of mixed methods, ratios and lengths; fresh selections (hooks hold state)."""
    plan = [("qcfuse", 0.15), ("cacheblend", 0.3), ("full", 1.0), ("naive", 0.2), ("qcfuse", 0.5), ("epic", 0.25)]
    out = []
    for p, (method, ratio) in zip(prompts, plan):
        if method == "full":
            q = _uncached(p)
            out.append(FuseItem(q, torch.arange(q.num_tokens), kv_out=KVCache(m, q.num_tokens + 4)))
            continue
        sel = get_selector(method).select(_ctx(m, p, ratio))
        out.append(FuseItem(p, sel.rows, sel.full_layers, sel.on_layer_end, KVCache(m, p.num_tokens + 4)))
    return out


def _alone(m, items):
    return [
        fused_prefill(m, it.prompt, it.rows, full_layers=it.full_layers, on_layer_end=it.on_layer_end, kv_out=it.kv_out)
        for it in items
    ]


@by_backend
@pytest.mark.parametrize("exact", [False, True])
def test_ragged_prefill_equals_each_alone(model, backend, exact):
    """Six requests of mixed methods, ratios and lengths: first-token logits within 1e-5 of
    each fused alone, the same final rows and row sets, the same KV caches; exact: bits."""
    prompts = _prompts(model)
    want_items = _items(model, prompts)
    want = _alone(model, want_items)
    items = _items(model, prompts)
    got = fused_prefill_batch(model, items, exact=exact)
    for g, w, gi, wi in zip(got, want, items, want_items):
        assert torch.equal(g.rows, w.rows)
        assert [(l, r.tolist()) for l, r in g.row_sets] == [(l, r.tolist()) for l, r in w.row_sets]
        T = gi.prompt.num_tokens
        if exact:
            assert torch.equal(g.logits, w.logits)
            assert torch.equal(gi.kv_out.k[:, :T], wi.kv_out.k[:, :T])
            assert torch.equal(gi.kv_out.v[:, :T], wi.kv_out.v[:, :T])
        else:
            assert (g.logits - w.logits).abs().max().item() < 1e-5
            torch.testing.assert_close(gi.kv_out.k[:, :T], wi.kv_out.k[:, :T], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gi.kv_out.v[:, :T], wi.kv_out.v[:, :T], atol=1e-5, rtol=1e-5)
        assert gi.kv_out.length == T


@pytest.mark.kernels
@pytest.mark.slow  # the whole model through the interpreter
def test_ragged_prefill_uses_one_attention_launch(model, monkeypatch):
    """The sparse rows of every request attend in one ragged launch per layer (the kernel
    path; the PyTorch reference runs it request by request)."""
    if K.backend() == "torch":
        pytest.skip("needs the Triton kernels (TRITON_INTERPRET=1 on a CPU, set by tests/conftest.py)")
    calls = []
    real = K.sparse_attention_varlen

    def counted(q, k, v, q_pos, cu_rows, cu_keys, *a, **kw):
        calls.append(len(cu_rows) - 1)
        return real(q, k, v, q_pos, cu_rows, cu_keys, *a, **kw)

    monkeypatch.setattr(K, "sparse_attention_varlen", counted)
    prompts = _prompts(model)
    items = [it for it in _items(model, prompts) if it.full_layers == 0 and it.rows.numel() < it.prompt.num_tokens]
    fused_prefill_batch(model, items)
    assert calls == [len(items)] * model.num_layers


@by_backend
def test_batch_of_one_is_fused_prefill(model, backend):
    prompts = _prompts(model)
    sel = get_selector("qcfuse").select(_ctx(model, prompts[0]))
    a = fused_prefill(model, prompts[0], sel.rows, logits_last=None, capture_pre_rope=True)
    b = fused_prefill_batch(model, [FuseItem(prompts[0], sel.rows, logits_last=None, capture_pre_rope=True)])[0]
    assert torch.equal(a.logits, b.logits) and torch.equal(a.k_pre, b.k_pre)


@by_backend
def test_ragged_prefill_checks_each_item(model, backend):
    prompts = _prompts(model)
    good = FuseItem(prompts[0], torch.arange(prompts[0].num_tokens))
    bad = FuseItem(prompts[1], torch.tensor([0, 1]))  # misses the suffix
    with pytest.raises(ValueError, match="last position|uncached"):
        fused_prefill_batch(model, [good, bad])
    assert fused_prefill_batch(model, []) == []


# ------------------------------------------------------------------ through the scheduler


DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(6 + 3 * i)) for i in range(6)]
# six requests of mixed methods, ratios and lengths: (method, ratio, documents)
MIXED = [
    ("qcfuse", 0.15, DOCS[:3]),
    ("cacheblend", 0.3, DOCS[2:5]),
    ("full", 1.0, DOCS[1:3]),
    ("naive", 0.2, DOCS),
    ("qcfuse", 0.5, DOCS[3:]),
    ("epic", 0.25, DOCS[:2]),
]
NEW = 5


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _engine(tiny, store=None, **cfg):
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.store import MemoryStore

    eng = QCFuseEngine(
        tiny,
        store=store if store is not None else MemoryStore(),
        config=engine_config(selection=OPTS, **{"batched_prefill": True, **cfg}),
    )
    eng.build_chunks(DOCS)
    return eng


def _together(eng, reqs):
    """Submit `reqs` so that one scheduler step admits them all: the first one's lookup holds
    the worker until the others wait in the queue. -> their results."""
    gate = hold_worker(eng)
    (m0, r0, d0), rest = reqs[0], reqs[1:]
    streams = [eng.stream("Which document is longest?", d0, method=m0, ratio=r0, max_new_tokens=NEW)]
    streams += [
        eng.stream(f"Which document mentions word{i}x2?", d, method=m, ratio=r, max_new_tokens=NEW)
        for i, (m, r, d) in enumerate(rest, 1)
    ]
    gate.set()
    for s in streams:
        list(s)
    return [s.result for s in streams]


def _one_by_one(eng, reqs):
    out = []
    for i, (m, r, d) in enumerate(reqs):
        q = "Which document is longest?" if i == 0 else f"Which document mentions word{i}x2?"
        out.append(eng.answer(q, d, method=m, ratio=r, max_new_tokens=NEW))
    return out


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_mixed_batch_answers_as_each_alone(tiny, deterministic):
    """Six requests of mixed methods, ratios and lengths admitted in one step and prefilled
    together: first-token logits within 1e-5 of each alone (deterministic: the same bits),
    the same greedy answers."""
    want = _one_by_one(_engine(tiny, deterministic=deterministic), MIXED)
    eng = _engine(tiny, deterministic=deterministic)
    got = _together(eng, MIXED)
    stats = eng.stats().scheduler
    assert stats.max_prefill_batch == len(MIXED) and stats.batched_prefills == 1
    for g, w, (method, _, _) in zip(got, want, MIXED):
        assert g.method == w.method == method
        assert g.token_ids == w.token_ids, method
        assert g.recomputed_tokens == w.recomputed_tokens
        if deterministic and method != "full":  # alone, full prefill is HF's own forward
            assert torch.equal(g.first_logits, w.first_logits), method
        else:
            assert (g.first_logits - w.first_logits).abs().max().item() < 1e-5, method
    if not deterministic:
        probed = [g.selection.details.get("probe_batch") for g in got if g.method == "qcfuse"]
        assert probed == [2, 2]  # the two qcfuse requests probed in one pass


def test_batched_prefill_off_prefills_one_at_a_time(tiny):
    want = _one_by_one(_engine(tiny), MIXED[:3])
    eng = _engine(tiny, batched_prefill=False)
    got = _together(eng, MIXED[:3])
    assert eng.stats().scheduler.batched_prefills == 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_a_failing_request_in_a_batch_fails_alone(tiny, monkeypatch):
    """One request's selection raises inside the batched prefill (its hook): it fails with
    that error; the others run again alone and answer as alone."""
    from qcfuse_core.selection import selectors

    want = _one_by_one(_engine(tiny), MIXED[:4])
    eng = _engine(tiny)
    real = selectors.CacheBlendSelector.select

    def broken(self, ctx):
        sel = real(self, ctx)

        def hook(state):
            raise RuntimeError("hook went wrong")

        sel.on_layer_end = hook
        return sel

    monkeypatch.setattr(selectors.CacheBlendSelector, "select", broken)
    gate = hold_worker(eng)
    m0, r0, d0 = MIXED[0]
    streams = [eng.stream("Which document is longest?", d0, method=m0, ratio=r0, max_new_tokens=NEW)]
    streams += [
        eng.stream(f"Which document mentions word{i}x2?", d, method=m, ratio=r, max_new_tokens=NEW)
        for i, (m, r, d) in enumerate(MIXED[1:4], 1)
    ]
    gate.set()
    for i, s in enumerate(streams):
        if MIXED[i][0] == "cacheblend":
            with pytest.raises(RuntimeError, match="hook went wrong"):
                list(s)
        else:
            list(s)
            assert s.result.token_ids == want[i].token_ids
    stats = eng.stats().scheduler
    assert (stats.failed, stats.finished) == (1, 3)


def test_a_chunk_shared_by_three_requests_is_loaded_once(tiny, tmp_path):
    """Three requests over a tiered store sharing a document, prefilled together: the shared
    chunk's layers cross to the device once (the batch's load counters), and each answer is
    its answer alone."""
    from qcfuse_core.store import open_store

    reqs = [("qcfuse", 0.3, [DOCS[5], DOCS[i]]) for i in range(3)]  # DOCS[5] in all three
    want = _one_by_one(_engine(tiny, store=open_store(tmp_path / "a", use_cuda=False)), reqs)
    eng = _engine(tiny, store=open_store(tmp_path / "b", use_cuda=False))
    got = _together(eng, reqs)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    loads = [g.load for g in got]
    assert all(ld["batch_size"] == 3 for ld in loads)
    alone = [w.load["bytes_loaded"] for w in want]
    assert loads[0]["batch_bytes_separate"] == sum(alone)
    # shared: the document, and the prefix (system prompt and header: one in-memory cache)
    prefix = [sp.end - sp.start for sp in got[0].spans if sp.kind == "prefix"]
    shared = eng.caches.chunk_tokens(DOCS[5])[0].numel() + sum(prefix)
    assert prefix and all([sp.end - sp.start for sp in g.spans if sp.kind == "prefix"] == prefix for g in got)
    shape = tiny.shape
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * tiny.dtype.itemsize
    assert loads[0]["batch_bytes_loaded"] == sum(alone) - 2 * shared * per_token  # loaded once, not three times
    assert sum(ld["bytes_loaded"] for ld in loads) == loads[0]["batch_bytes_loaded"]
