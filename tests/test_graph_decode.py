"""Decode attention over each sequence's own cache (qcfuse_kernels.decode_attention, kv_append)
against the PyTorch references, and the graph decoder's step body (model/graphs.decode_rows)
against model.batched.decode_batch; on a GPU, graph-replayed steps against eager ones.

CPU: Triton's interpreter on small shapes (tests/conftest.py sets TRITON_INTERPRET=1).
GPU (TRITON_INTERPRET=0 on a CUDA host): compiled kernels and CUDA graphs.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch

import qcfuse_kernels as K
from qcfuse_core.model import batched
from qcfuse_core.model.graphs import GraphDecoder, decode_rows, layer_addresses
from qcfuse_core.model.testing import tiny_model
from qcfuse_kernels import reference as ref
from tests.qc_fixtures import TOL, _caches, _copy, assert_close, needs_cuda, needs_interpreter, use_backend  # noqa: F401

pytestmark = pytest.mark.kernels


def _rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _batch(B, H, Hkv, D, caps, lens, dtype, device="cpu"):
    q = _rand(B, H, D, dtype=dtype, device=device)
    ks = [_rand(c, Hkv, D, dtype=dtype, seed=10 + b, device=device) for b, c in enumerate(caps)]
    vs = [_rand(c, Hkv, D, dtype=dtype, seed=50 + b, device=device) for b, c in enumerate(caps)]
    return q, ks, vs, torch.tensor(lens, device=device)


# ---------------------------------------------------------------- kernels, interpreter (CPU)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3), (8, 1)], ids=str)
@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_matches_reference(use_backend, dtype, heads, window):
    """Sequences of different capacities and lengths (1 key, a partial last block, a full
    cache, more keys than the splits' blocks) and GQA groups of 1, 3, 4 and 8."""
    H, Hkv = heads
    q, ks, vs, lens = _batch(4, H, Hkv, 16, caps=[40, 3, 70, 90], lens=[33, 1, 70, 81], dtype=dtype)
    out = K.decode_attention(q, ks, vs, lens, 0.3, window)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref.decode_attention_ref(q, ks, vs, lens, 0.3, window), what="decode_attention", **TOL[dtype])


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_decode_attention_row_does_not_depend_on_its_batch(use_backend):
    """A row's output bits are the same alone and with other rows (the key ranges follow its
    own length), and the same on a second run."""
    q, ks, vs, lens = _batch(3, 6, 2, 16, caps=[50, 64, 20], lens=[50, 37, 9], dtype=torch.float32)

    def attend(rows):
        return K.decode_attention_ptrs(q[rows].contiguous(), K.cache_addresses([ks[b] for b in rows]),
                                       K.cache_addresses([vs[b] for b in rows]), lens[rows], 0.25,
                                       num_kv_heads=2, splits=4)

    both = attend([0, 1, 2])
    assert_close(both, ref.decode_attention_ref(q, ks, vs, lens, 0.25), what="4 splits", **TOL[torch.float32])
    assert torch.equal(both, attend([0, 1, 2]))
    for b in range(3):
        assert torch.equal(attend([b])[0], both[b])


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_append_writes_each_row_into_its_own_cache(use_backend, dtype):
    _, ks, vs, _ = _batch(3, 4, 2, 16, caps=[5, 9, 2], lens=[1, 1, 1], dtype=dtype)
    k, v = _rand(3, 2, 16, dtype=dtype, seed=7), _rand(3, 2, 16, dtype=dtype, seed=8)
    pos = torch.tensor([4, 0, 1])
    want_k, want_v = [c.clone() for c in ks], [c.clone() for c in vs]
    ref.kv_append_ref(want_k, want_v, pos, k, v)
    K.kv_append(ks, vs, pos, k, v)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, want_k + want_v))
    assert torch.equal(ks[0][4], k[0]) and torch.equal(vs[2][1], v[2])


@pytest.mark.parametrize("use_backend", ["torch"], indirect=True)
def test_decode_attention_refuses_bad_input(use_backend):
    q, ks, vs, lens = _batch(2, 4, 2, 8, caps=[6, 6], lens=[3, 6], dtype=torch.float32)
    with pytest.raises(ValueError, match="2 caches for 2|holds 1 caches"):
        K.decode_attention(q, ks[:1], vs, lens, 0.5)
    with pytest.raises(ValueError, match=r"lens\[1\] = 7 outside \[1, 6\]"):
        K.decode_attention(q, ks, vs, torch.tensor([3, 7]), 0.5)
    with pytest.raises(ValueError, match="need \\(capacity, 2, 8\\)"):
        K.decode_attention(q, [ks[0], torch.zeros(6, 3, 8)], vs, lens, 0.5)
    with pytest.raises(ValueError, match="not a multiple"):
        K.decode_attention(q, [torch.zeros(6, 3, 8)] * 2, vs, lens, 0.5)
    with pytest.raises(ValueError, match="window"):
        K.decode_attention(q, ks, vs, lens, 0.5, window=0)
    with pytest.raises(ValueError, match=r"pos\[0\] = 6 outside"):
        K.kv_append(ks, vs, torch.tensor([6, 0]), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    with pytest.raises(RuntimeError, match="kernel backend"):
        K.decode_attention_ptrs(q, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), lens, 0.5,
                                num_kv_heads=2)


# ---------------------------------------------------------------- the graph's step body (CPU)



def _rows_step(adapter, caches, tokens):
    """decode_rows eagerly, as GraphDecoder feeds it (the caches' lengths advanced here)."""
    pos = torch.tensor([c.length for c in caches])
    ids = torch.tensor(tokens)
    kp, vp = layer_addresses([c.k for c in caches]), layer_addresses([c.v for c in caches])
    dev = adapter.device
    out = decode_rows(adapter, ids.to(dev), pos.to(dev), (pos + 1).to(dev), kp.to(dev), vp.to(dev))
    for c in caches:
        c.length += 1
    return out


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize(
    "arch",  # a whole model through the interpreter: one architecture in the fast tier, the rest slow
    ["llama"] + [pytest.param(a, marks=pytest.mark.slow) for a in ("qwen3", "gemma3", "mistral-swa")],
)
def test_decode_rows_matches_decode_batch(use_backend, arch):
    """Three sequences (past the tiny sliding windows), four steps: the logits and the caches
    written match decode_batch's (fp32: the attention sums in another order) and the greedy
    tokens are the same."""
    m = tiny_model(arch)
    with torch.inference_mode():
        caches = _caches(m, (5, 23, 14), room=6)
        mine, theirs = [_copy(c) for c in caches], [_copy(c) for c in caches]
        gen = torch.Generator().manual_seed(3)
        for step in torch.randint(0, 256, (4, 3), generator=gen).tolist():
            a, b = _rows_step(m, mine, step), batched.decode_batch(m, theirs, step)
            assert_close(a, b, 2e-4, 1e-4, f"{arch} logits")
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for x, y in zip(mine, theirs):
            assert x.length == y.length
            assert_close(x.k[:, : x.length], y.k[:, : y.length], 1e-5, 1e-5, "keys written")
            assert_close(x.v[:, : x.length], y.v[:, : y.length], 1e-5, 1e-5, "values written")


def test_graph_decoder_needs_cuda():
    m = tiny_model("llama")
    with pytest.raises(ValueError, match="CUDA device"):
        GraphDecoder(m)


# ---------------------------------------------------------------- CUDA graphs (GPU)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_steps_match_eager_steps_on_cuda(use_backend, deterministic):
    """Sequences joining and leaving between steps (buckets of 1 to 8 rows and back), each on
    its own cache: graph replays match decode_rows run eagerly and decode_batch's greedy
    tokens; the same steps replayed again give the same bits; in the deterministic mode a
    sequence's logits are the same alone and batched."""
    m = tiny_model("llama")
    m.model.to("cuda")
    with torch.inference_mode():
        base = _caches(m, (5, 40, 17, 3, 60, 9, 33, 12), room=8)
        g = GraphDecoder(m, deterministic=deterministic)
        gen = torch.Generator().manual_seed(5)
        plan = [(members, torch.randint(0, 256, (len(members),), generator=gen).tolist())
                for members in ([0], [0, 1, 2], list(range(8)), [3, 5], [6])]
        runs = []
        for _ in range(2):
            graphed, eager, plain = ([_copy(c) for c in base] for _ in range(3))
            logits = []
            for members, toks in plan:
                a = g.step([graphed[i] for i in members], toks)
                b = _rows_step(m, [eager[i] for i in members], toks)
                c = batched.decode_batch(m, [plain[i] for i in members], toks)
                assert_close(a, b, 1e-4, 1e-4, "graph vs eager")
                assert torch.equal(a.argmax(-1), c.argmax(-1))
                logits.append(a)
            assert all(x.length == y.length for x, y in zip(graphed, eager))
            runs.append(logits)
        assert all(torch.equal(x, y) for x, y in zip(*runs))
        if deterministic:
            alone = [_copy(c) for c in base]
            rows = g.step([_copy(c) for c in base], list(range(8)))
            for i in range(8):
                assert torch.equal(g.step([alone[i]], [i])[0], rows[i])
        assert g.captures == (1 if deterministic else 6)  # every bucket, at the first step
