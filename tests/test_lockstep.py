"""Lockstep decoding (qcfuse_core/model/batched.py) and the bench's shared greedy / teacher-forced
decode (bench_quality.decode_answers) give the plain one-token-at-a-time results bit for bit."""

import pytest
import torch

from qcfuse_core.model import batched as lockstep
from qcfuse_core.eval import quality
from qcfuse_core.eval.quality import _greedy_seq, decode_answers, forced_logits
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.fusion import KVCache, decode_step, fill_from_hf
from qcfuse_core.model.testing import TINY_CONFIGS, tiny_model


def _cache(adapter, ids: torch.Tensor, room: int) -> tuple[KVCache, torch.Tensor]:
    logits, kv = adapter.hf_forward(ids)
    cache = KVCache(adapter, ids.numel() + room)
    fill_from_hf(cache, kv)
    return cache, logits[-1]


def _copy(cache: KVCache) -> KVCache:
    out = KVCache.__new__(KVCache)
    out.k, out.v, out.length = cache.k.clone(), cache.v.clone(), cache.length
    return out


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("block", [lockstep.HEAD_BLOCK, 48])
def test_decode_steps_equal_decode_step_bit_for_bit(arch, block, monkeypatch):
    """Three sequences of different lengths (past the tiny sliding windows), five steps each:
    the logits and the written caches equal decode_step's exactly; block 48 splits the LM
    head (256 rows) into uneven blocks."""
    monkeypatch.setattr(lockstep, "HEAD_BLOCK", block)
    m = tiny_model(arch)
    gen = torch.Generator().manual_seed(1)
    caches = [_cache(m, torch.randint(0, 256, (n,), generator=gen), 8)[0] for n in (5, 23, 40)]
    plain, both = [_copy(c) for c in caches], [_copy(c) for c in caches]
    toks = torch.randint(0, 256, (5, 3), generator=gen).tolist()
    for step in toks:
        want = [decode_step(m, c, t) for c, t in zip(plain, step)]
        got = lockstep.decode_steps(m, both, step)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
    for p, b in zip(plain, both):
        assert p.length == b.length
        assert torch.equal(p.k[:, : p.length], b.k[:, : b.length]) and torch.equal(p.v[:, : p.length], b.v[:, : b.length])


def test_decode_steps_refuse_a_full_or_shared_cache():
    m = tiny_model("llama")
    a, _ = _cache(m, torch.arange(6), 0)
    b, _ = _cache(m, torch.arange(7), 2)
    with pytest.raises(ValueError, match="full"):
        lockstep.decode_steps(m, [a, b], [1, 2])
    with pytest.raises(ValueError, match="own cache"):
        lockstep.decode_steps(m, [b, b], [1, 2])


def test_decode_answers_equal_greedy_and_forced_logits_with_fewer_steps(monkeypatch):
    """decode_answers == _greedy_seq + forced_logits per cache (answers, forced rows, bit for
    bit) for a cache whose greedy answer is seq itself, one that leaves it after 3 tokens and
    others; and it decodes only what the greedy answers could not share: the one whose answer
    is seq needs no forced step."""
    m = tiny_model("llama", tokenizer=True)
    eng = QCFuseEngine(m)
    gen = torch.Generator().manual_seed(2)
    max_new = 9
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (17, 17, 30, 12)]
    prompts[1] = prompts[0].clone()
    made = [_cache(m, p, max_new) for p in prompts]
    # seq: prompt 0's own greedy answer
    c0 = _copy(made[0][0])
    ids0, _, _ = _greedy_seq(eng, c0, made[0][1], max_new)
    for seq, eos in ((ids0, set()), (ids0[:3] + [(ids0[3] + 1) % 256] + ids0[4:], set()), (ids0[:5] + [ids0[5]], {ids0[5]})):
        monkeypatch.setattr(quality, "eos_ids", lambda adapter, e=eos: set(e))
        want = []
        for cache, first in made:
            c = _copy(cache)
            ids, _, _ = _greedy_seq(eng, c, first, max_new)
            want.append((ids, forced_logits(eng, _copy(cache), first, seq)))
        calls = []
        real = lockstep.decode_steps

        def counting(adapter, caches, tokens):
            calls.append(len(tokens))
            return real(adapter, caches, tokens)

        monkeypatch.setattr(lockstep, "decode_steps", counting)
        caches = [_copy(c) for c, _ in made]
        ids, rows = decode_answers(eng, caches, [f for _, f in made], seq, max_new)
        monkeypatch.setattr(lockstep, "decode_steps", real)
        for (w_ids, w_rows), g_ids, g_rows, (c, _) in zip(want, ids, rows, zip(caches, prompts)):
            assert g_ids == w_ids and g_rows.shape == w_rows.shape and torch.equal(g_rows, w_rows)
        assert all(c.length == p.numel() for c, p in zip(caches, prompts))
        # decode steps: each greedy answer's own, plus the forced rows it could not share
        greedy = sum(min(len(w), max_new - 1) if len(w) == max_new else len(w) for w, _ in want)
        shared = []
        for w_ids, _ in want:
            k = 0
            while k < min(len(w_ids), len(seq) - 1) and w_ids[k] == seq[k]:
                k += 1
            shared.append(k)
        assert sum(calls) == greedy + sum(max(0, len(seq) - 1) - k for k in shared)
        if seq == ids0 and not eos:  # prompts 0 and 1 answer seq itself: nothing forced for them
            assert shared[0] == shared[1] == len(seq) - 1
