"""fp8 KV caches (`CacheConfig.kv_dtype="fp8"`): e4m3 codes with one fp32 scale per token and
KV head. The kernels that write them (`rope_append_ptrs`, `kv_append_ptrs`) and read them
(`decode_attention_ptrs`) against the plain PyTorch reference (`quantize_fp8_rows`,
`decode_attention_ref` with scales) within fp8's rounding; the graph's step body on fp8 caches
against the eager path; the fused prefill writing fp8; the engine on an fp8 pool.

CPU: Triton's interpreter on small shapes; the CUDA tests run in benchmarks/gpu.sh's `tests` step.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch

import qcfuse_kernels as K
from qcfuse_core import CacheConfig
from qcfuse_core.model import batched
from qcfuse_core.model.fusion import KVCache, fill_from_hf
from qcfuse_core.model.graphs import GraphDecoder, cache_tables, decode_rows
from qcfuse_core.model.runner import ModelRunner
from qcfuse_core.model.testing import tiny_model
from qcfuse_kernels import reference as ref
from tests.qc_fixtures import TOL, assert_close, docs_engine, needs_cuda, needs_interpreter, use_backend  # noqa: F401, F811

pytestmark = pytest.mark.kernels

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(10)) for i in range(4)]


def _rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values near x (3 mantissa bits; subnormal step 2^-9)."""
    e = torch.floor(torch.log2(x.float().abs().clamp(min=2.0**-6)))
    return torch.exp2(e - 3)


# the rows a kernel quantizes are rounded to the model's dtype first: in bf16 the interpreter
# truncates where torch rounds (one bf16 step, 2^-7 relative at most)
SCALE_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}


def assert_codes_close(codes, scales, want_codes, want_scales, what, dtype=torch.float32):
    """fp8 rows equal the reference's within fp8's rounding: scales within the rounding of the
    row they come from, codes equal or one e4m3 step apart (a quotient near a tie; in fp32,
    rare)."""
    assert codes.dtype == torch.float8_e4m3fn
    assert_close(scales, want_scales, 0, SCALE_RTOL[dtype], f"{what}: scales")
    diff = (codes.float() - want_codes.float()).abs()
    assert bool((diff <= _ulp(want_codes)).all()), f"{what}: codes more than one e4m3 step apart"
    if dtype == torch.float32:
        assert (diff > 0).float().mean() < 0.02, f"{what}: too many codes off by one step"


def test_quantized_rows_decode_within_the_fp8_bound():
    """|x - decode(x)| <= |x| / 16 + scale / 1024 per element; an all-zero row gets scale 1."""
    x = _rand(7, 3, 64) * torch.logspace(-3, 2, 7)[:, None, None]
    x[2, 1] = 0
    q, sc = K.quantize_fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and sc.shape == (7, 3) and sc[2, 1] == 1
    back = K.dequantize_fp8_rows(q, sc)
    assert bool(((x - back).abs() <= x.abs() / 16 + sc[..., None] / 1024).all())
    assert torch.allclose(q.float().abs().amax(-1)[sc != 1], torch.full_like(sc[sc != 1], 448.0))


def _fp8_caches(caps, Hkv, D, seed, device="cpu"):
    ks, kss, vs, vss = [], [], [], []
    for b, c in enumerate(caps):
        k, ksc = K.quantize_fp8_rows(_rand(c, Hkv, D, seed=seed + b, device=device) * (1 + b))
        v, vsc = K.quantize_fp8_rows(_rand(c, Hkv, D, seed=seed + 50 + b, device=device))
        ks.append(k), kss.append(ksc), vs.append(v), vss.append(vsc)
    return ks, kss, vs, vss


def _addr(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=ts[0].device)


def _attention_case(dtype, heads, window, device):
    H, Hkv = heads
    D, caps = 32, [40, 9, 70]
    lens = torch.tensor([40, 3, 61], device=device)
    q = _rand(3, H, D, dtype=dtype, seed=1, device=device)
    ks, kss, vs, vss = _fp8_caches(caps, Hkv, D, 10, device)
    want = ref.decode_attention_ref(q, ks, vs, lens, 0.3, window, kss, vss)
    got = K.decode_attention_ptrs(
        q,
        _addr(ks),
        _addr(vs),
        lens,
        0.3,
        num_kv_heads=Hkv,
        window=window,
        splits=4,
        k_scale_ptrs=_addr(kss),
        v_scale_ptrs=_addr(vss),
    )
    return got, want


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=str)
@pytest.mark.parametrize("window", [None, 8])
def test_fp8_decode_attention_matches_the_reference(use_backend, dtype, heads, window):
    """Sequences of different lengths (one inside a split), GQA groups, a sliding window: the
    kernel reading codes and scales equals the reference on the dequantized caches."""
    got, want = _attention_case(dtype, heads, window, "cpu")
    assert got.dtype == dtype
    assert_close(got, want, what="fp8 attention", **TOL[dtype])


def _writes_case(dtype, heads, device):
    H, Hkv = heads
    B, D = 3, 16
    qkv = _rand(B, (H + 2 * Hkv) * D, dtype=dtype, seed=1, device=device) * 3
    ang = _rand(B, D // 2, seed=3) * 3
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    caps, pos = [7, 3, 12], torch.tensor([6, 0, 5], device=device)
    ks, kss, vs, vss = _fp8_caches(caps, Hkv, D, 20, device)
    before = [t.clone() for t in ks + kss]
    q = K.rope_append_ptrs(
        qkv,
        cos,
        sin,
        _addr(ks),
        _addr(vs),
        pos,
        num_heads=H,
        num_kv_heads=Hkv,
        k_scale_ptrs=_addr(kss),
        v_scale_ptrs=_addr(vss),
    )
    # the reference: rotate in the model's dtype, then quantize the rows
    rk = [torch.zeros(c, Hkv, D, dtype=dtype, device=device) for c in caps]
    rv = [torch.zeros(c, Hkv, D, dtype=dtype, device=device) for c in caps]
    want_q = ref.rope_append_ref(qkv, cos, sin, rk, rv, pos, H, Hkv)
    return q, want_q, (ks, kss, vs, vss), (rk, rv), pos, before


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=str)
def test_fp8_rope_append_writes_the_references_codes(use_backend, dtype, heads):
    """The rotated key and the value quantized at each row's position (codes and scales as
    `quantize_fp8_rows` gives them), every other row untouched, the queries as in bf16."""
    q, want_q, (ks, kss, vs, vss), (rk, rv), pos, before = _writes_case(dtype, heads, "cpu")
    assert_close(q, want_q, what="queries", **TOL[dtype])
    for b, p in enumerate(pos.tolist()):
        for codes, scales, x in ((ks, kss, rk), (vs, vss, rv)):
            wc, wsc = K.quantize_fp8_rows(x[b][p])
            assert_codes_close(codes[b][p], scales[b][p], wc, wsc, f"row {b}", dtype)
        others = torch.arange(ks[b].shape[0]) != p
        assert torch.equal(ks[b][others].float(), before[b][others].float())
        assert torch.equal(kss[b][others], before[3 + b][others])


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_fp8_kv_append_writes_the_references_codes(use_backend):
    Hkv, D = 2, 16
    ks, kss, vs, vss = _fp8_caches([5, 4], Hkv, D, 30)
    k, v = _rand(2, Hkv, D, seed=2) * 5, _rand(2, Hkv, D, seed=3)
    k[1, 0] = 0  # an all-zero head: scale 1
    pos = torch.tensor([4, 1])
    K.kv_append_ptrs(_addr(ks), _addr(vs), pos, k, v, _addr(kss), _addr(vss))
    for b, p in enumerate(pos.tolist()):
        for codes, scales, x in ((ks, kss, k), (vs, vss, v)):
            wc, wsc = K.quantize_fp8_rows(x[b])
            assert_codes_close(codes[b][p], scales[b][p], wc, wsc, f"row {b}")
    assert kss[1][1, 0] == 1
    with pytest.raises(ValueError, match="both k_scale_ptrs and v_scale_ptrs"):
        K.kv_append_ptrs(_addr(ks), _addr(vs), pos, k, v, _addr(kss), None)


def _fp8_copy(adapter, lengths, room, seed=1):
    """Caches of random prompts written by fill_from_hf into fp8 caches (the reference path)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        _, kv = adapter.hf_forward(torch.randint(0, 256, (n,), generator=gen).to(adapter.device))
        c = KVCache(adapter, n + room, "fp8")
        fill_from_hf(c, kv)
        out.append(c)
    return out


def _rows_step(adapter, caches, tokens):
    pos = torch.tensor([c.length for c in caches])
    dev = adapter.device
    t = cache_tables(caches).to(dev)
    L = adapter.num_layers
    out = decode_rows(
        adapter,
        torch.tensor(tokens).to(dev),
        pos.to(dev),
        (pos + 1).to(dev),
        t[:L],
        t[L : 2 * L],
        scale_ptrs=(t[2 * L : 3 * L], t[3 * L :]),
    )
    for c in caches:
        c.length += 1
    return out


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_graph_step_body_on_fp8_caches_matches_the_reference_path(use_backend, arch):
    """Three sequences, three steps on fp8 caches: decode_rows' kernels (packed projections;
    Gemma 3: the adapter's own steps, `kv_append_ptrs`, sliding windows) against decode_batch,
    which writes through `KVCache.write` and reads the dequantized rows: logits within fp8's
    rounding, the same greedy tokens, the codes written within a step."""
    m = tiny_model(arch)
    with torch.inference_mode():
        mine = _fp8_copy(m, (5, 23, 14), room=4)
        theirs = [c.clone() for c in mine]
        assert mine[0].fp8 and mine[0].k.dtype == torch.float8_e4m3fn
        for tokens in ([3, 100, 7], [50, 2, 255], [9, 9, 9]):
            a = _rows_step(m, mine, tokens)
            b = batched.decode_batch(m, theirs, tokens)
            assert_close(a, b, 2e-3, 2e-3, "fp8 logits")
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for x, y in zip(mine, theirs):
            n = x.length
            for layer in range(m.num_layers):
                assert_codes_close(x.k[layer, :n], x.k_scale[layer, :n], y.k[layer, :n], y.k_scale[layer, :n], "keys")


def test_fp8_cache_reads_and_writes_through_the_reference():
    """`KVCache.write` quantizes, `read` gives rows within the fp8 bound; bytes are codes + scales."""
    m = tiny_model("llama")
    c = KVCache(m, 6, "fp8")
    k, v = _rand(6, m.shape.num_kv_heads, m.shape.head_dim), _rand(6, m.shape.num_kv_heads, m.shape.head_dim, seed=1)
    c.write(1, slice(0, 6), k, v)
    rk, rv = c.read(1, 0, 6)
    assert rk.dtype == m.dtype
    for x, back, sc in ((k, rk, c.k_scale[1]), (v, rv, c.v_scale[1])):
        assert bool(((x - back).abs() <= x.abs() / 16 + sc[..., None] / 1024 + 1e-7).all())
    s = m.shape
    assert c.nbytes == KVCache.bytes_for(m, 6, "fp8") == 2 * s.num_layers * 6 * s.num_kv_heads * (s.head_dim + 4)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        KVCache(m, 6, "int4")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        CacheConfig(kv_dtype="bf8")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


@pytest.mark.parametrize("use_backend", ["torch"], indirect=True)  # the engine's CPU path: the references
def test_an_fp8_engine_prefills_into_fp8_and_answers_near_the_bf16_one(use_backend, tiny, monkeypatch):
    """An engine with CacheConfig(kv_dtype="fp8"): every request's buffer is fp8 (the fused
    prefill writes codes), reservations count codes + scales, and its greedy answers start as
    the model-dtype engine's (the tiny random model's logits are far apart at the first token)."""
    from qcfuse_core.cache import budget

    made = []
    real = KVCache.__init__
    monkeypatch.setattr(KVCache, "__init__", lambda self, *a, **k: made.append(self) or real(self, *a, **k))
    fp8 = docs_engine(tiny, DOCS, kv_dtype="fp8")
    plain = docs_engine(tiny, DOCS)
    for i, method in enumerate(("full", "qcfuse", "cacheblend")):
        q = f"Which document mentions word{i}x{i + 1}?"
        a = fp8.answer(q, DOCS, method=method, ratio=0.3, max_new_tokens=6)
        b = plain.answer(q, DOCS, method=method, ratio=0.3, max_new_tokens=6)
        assert a.token_ids[0] == b.token_ids[0] and len(a.token_ids) == 6
    assert fp8.kv_budget.kv_dtype == "fp8" and any(c.fp8 for c in made)
    # a prompt prefilled in slices: the later slices write their rows into the fp8 cache by
    # index and read the codes back
    sliced = docs_engine(tiny, DOCS, kv_dtype="fp8", step_prefill_tokens=24)
    q = "Which document mentions word2x3?"
    a = sliced.answer(q, DOCS, method="full", max_new_tokens=4)
    assert a.token_ids[0] == fp8.answer(q, DOCS, method="full", max_new_tokens=4).token_ids[0]
    assert sliced.stats().scheduler.prefill_slices > 1
    r = fp8.kv_budget.reserve(40)
    assert r is not None and r.nbytes == KVCache.bytes_for(tiny, 40, "fp8") and r.kv().fp8
    fp8.kv_budget.release(r)
    assert plain.kv_budget.kv_dtype == "auto" and budget.KVBudget(tiny, fp8.kv_budget.store).kv_dtype == "auto"


# ---------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("heads", [(4, 4), (8, 1)], ids=str)
@pytest.mark.parametrize("window", [None, 8])
def test_fp8_kernels_match_the_reference_on_cuda(use_backend, heads, window):
    got, want = _attention_case(torch.bfloat16, heads, window, "cuda")
    assert_close(got, want, what="fp8 attention (CUDA)", **TOL[torch.bfloat16])
    q, want_q, (ks, kss, vs, vss), (rk, rv), pos, _ = _writes_case(torch.bfloat16, heads, "cuda")
    assert_close(q, want_q, what="queries (CUDA)", **TOL[torch.bfloat16])
    for b, p in enumerate(pos.tolist()):
        for codes, scales, x in ((ks, kss, rk), (vs, vss, rv)):
            wc, wsc = K.quantize_fp8_rows(x[b][p])
            # on a GPU both round to nearest: the bf16 rows are the same
            assert_codes_close(codes[b][p].cpu(), scales[b][p].cpu(), wc.cpu(), wsc.cpu(), f"row {b} (CUDA)")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
def test_fp8_graph_steps_match_the_reference_path_on_cuda(use_backend):
    """CUDA graphs on fp8 caches, sequences joining and leaving: logits within fp8's rounding
    of decode_batch's (reference reads), the same greedy tokens."""
    m = tiny_model("llama")
    m.model.to("cuda")
    with torch.inference_mode():
        base = _fp8_copy(m, (5, 40, 17, 3, 60), room=6)
        g = GraphDecoder(m, kv_fp8=True)
        graphed, plain = [c.clone() for c in base], [c.clone() for c in base]
        gen = torch.Generator().manual_seed(5)
        for members in ([0], [0, 1, 2], list(range(5)), [3, 4]):
            toks = torch.randint(0, 256, (len(members),), generator=gen).tolist()
            a = g.step([graphed[i] for i in members], toks)
            b = batched.decode_batch(m, [plain[i] for i in members], toks)
            assert_close(a, b, 2e-3, 2e-3, "fp8 graph vs reference")
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        with pytest.raises(ValueError, match="model-dtype|fp8"):
            GraphDecoder(m).step([KVCache(m, 4, "fp8")], [1])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_device_sampling_in_graphs_gives_the_host_argmax_on_cuda(use_backend, kv_dtype):
    """ModelRunner.launch on CUDA graphs (argmax in the graph, fed on the device, read one step
    late): the same tokens as decode + the host's argmax, the logits as close as two captures
    of one step."""
    m = tiny_model("llama")
    m.model.to("cuda")
    with torch.inference_mode():
        base = _fp8_copy(m, (5, 40, 17), room=8) if kv_dtype == "fp8" else None
        if base is None:
            base = [c for c in _fp8_copy(m, (5, 40, 17), room=8)]
            base = [_model_dtype(m, c) for c in base]
        ahead, host = ModelRunner(m), ModelRunner(m)
        mine, theirs = [c.clone() for c in base], [c.clone() for c in base]
        launched = ahead.launch(mine, [3, 100, 7])
        want = host.argmax(list(host.decode(theirs, [3, 100, 7])))
        assert ahead.graphs and host.graphs
        for _ in range(5):
            nxt = ahead.launch(mine, [0, 0, 0], [0, 1, 2])
            assert launched.tokens() == want
            logits = host.decode(theirs, want)
            assert_close(nxt.logits, logits, 1e-5, 1e-5, "fed on the device vs from the host")  # two graphs
            want = host.argmax(list(logits))
            launched = nxt
        assert launched.tokens() == want


def _model_dtype(m, c):
    out = KVCache(m, c.capacity)
    for layer in range(m.num_layers):
        out.write(layer, slice(None), *c.read(layer, 0, c.capacity))
    out.length = c.length
    return out


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_engine_answers_ahead_as_the_host_path_on_cuda(kv_dtype):
    """The engine on CUDA (graphs, decode_ahead on) against decode_ahead off: five greedy
    requests of different lengths, batched, token for token the same."""
    from tests.qc_fixtures import hold_worker

    m = tiny_model("llama", tokenizer=True)
    m.model.to("cuda")

    def run(eng):
        gate = hold_worker(eng)
        streams = [
            eng.stream(f"Which document mentions word{i}x{i}?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=n)
            for i, n in enumerate((3, 9, 5, 12, 7))
        ]
        gate.set()
        out = []
        for s in streams:
            list(s)
            out.append(s.result.token_ids)
        return out

    want = run(docs_engine(m, DOCS, decode_ahead=False, kv_dtype=kv_dtype))
    eng = docs_engine(m, DOCS, decode_ahead=True, kv_dtype=kv_dtype)
    assert run(eng) == want
    assert eng._sched is not None and eng._sched.runner.graphs


class _Opened(Exception):
    pass


def test_serve_kv_dtype_reaches_the_engines_config(tmp_path, monkeypatch):
    """`qcfuse serve --kv-dtype fp8` opens its engine with CacheConfig(kv_dtype="fp8"); a bad
    value is refused when the command line is parsed."""
    from qcfuse_core.cli.commands import main

    seen = {}

    def opened(*args, config=None, **kw):
        seen["config"] = config
        raise _Opened

    monkeypatch.setattr("qcfuse_core.engine.api.open_engine", opened)
    with pytest.raises(_Opened):
        main(["serve", "--kv-dtype", "fp8", "--port", "0", "--store", str(tmp_path / "s")])
    assert seen["config"].cache.kv_dtype == "fp8" and seen["config"].cache.promote_disk_reads
    with pytest.raises(SystemExit):
        main(["serve", "--kv-dtype", "fp4", "--store", str(tmp_path / "s")])


@pytest.mark.parametrize("use_backend", ["torch"], indirect=True)
def test_bench_load_runs_on_an_fp8_pool(use_backend, tmp_path, monkeypatch):
    """`qcfuse bench load --kv-dtype fp8`: every request's buffer is fp8, every request
    finishes its answer, and the rows say which KV dtype ran."""
    import json

    from qcfuse_core.cli.commands import main

    made = []
    real = KVCache.__init__
    monkeypatch.setattr(KVCache, "__init__", lambda self, *a, **k: made.append(self) or real(self, *a, **k))
    out = tmp_path / "load.json"
    small = ["--shape", "tiny-llama", "--dtype", "fp32", "--pool-chunks", "6", "--chunk-tokens", "24",
             "--chunks-per-request", "3", "--query-tokens", "4", "--prefix-tokens", "4"]
    rc = main(["bench", "load", *small, "--max-new-tokens", "6", "--clients", "2", "--requests-per-client", "1",
               "--methods", "qcfuse", "--kv-dtype", "fp8", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["kv_dtype"] == "fp8" and r["finished"] == 2 and r["errors"] == 0 for r in rows)
    served = [c for c in made if c.capacity > 24]  # the requests' buffers (prompt + new tokens)
    assert served and all(c.fp8 for c in served)
