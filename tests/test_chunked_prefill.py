"""Chunked prefill: a prompt's prefill split into slices of positions run over several
scheduler steps (model/fusion.py `fused_prefill`'s `span`, `prefill_slices`; engine/scheduler.py).

Oracles: the same prefill unsliced (fp32, tiny random models: logits and every layer's
K/V to float tolerance, answers token for token); the same request alone in deterministic
mode (bit for bit); and the scheduler's own steps - a request decoding gets its token in
every step while a long prompt's prefill spans several."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.fusion import FusedPrompt, KVCache, Segment, fused_prefill, prefill_slices
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore
from tests.qc_fixtures import KINDS, engine_config, prompt_alone, report

ATOL = 2e-5  # fp32
LENS = [7, 23, 2, 31, 17, 9]


def test_prefill_slices_split_the_rows_end_to_end():
    rows = torch.tensor([0, 1, 5, 6, 7, 20, 21, 29])
    assert prefill_slices(rows, 3) == [(0, 6), (6, 21), (21, 30)]
    assert prefill_slices(rows, 8) == [(0, 30)]
    assert prefill_slices(torch.arange(10), 4) == [(0, 4), (4, 8), (8, 10)]


def _sliced(m, prompt: FusedPrompt, rows: torch.Tensor, size: int):
    """The prompt's fused prefill slice by slice into one cache -> (last logits, cache)."""
    cache = KVCache(m, prompt.num_tokens + 2)
    spans = prefill_slices(rows, size)
    assert len(spans) > 1
    for a, b in spans:
        part = rows[(rows >= a) & (rows < b)]
        out = fused_prefill(m, prompt, part, kv_out=cache, span=(a, b))
        assert out.logits.numel() == 0 if b < prompt.num_tokens else out.logits.shape[0] == 1
        assert cache.length == b
    return out.logits, cache


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral-swa"])
@pytest.mark.parametrize("share", [1.0, 0.3])
def test_a_sliced_prefill_equals_the_whole(arch, share):
    """Every row (full prefill) or a sparse row set over cached chunks, in slices of 5 and 16
    rows: the last logits and every layer's K/V are the unsliced prefill's (windows: gemma3's
    and mistral-swa's sliding layers; both GQA)."""
    m = tiny_model(arch)
    prompt = prompt_alone(m, LENS, KINDS, seed=3)
    T = prompt.num_tokens
    g = torch.Generator().manual_seed(4)
    rows = torch.nonzero((torch.rand(T, generator=g) < share) | prompt.uncached_mask()).flatten()
    whole = KVCache(m, T + 2)
    ref = fused_prefill(m, prompt, rows, kv_out=whole).logits
    for size in (5, 16):
        logits, cache = _sliced(m, prompt, rows, size)
        assert torch.allclose(logits, ref, atol=ATOL, rtol=0), report(logits, ref)
        for got, want in ((cache.k, whole.k), (cache.v, whole.v)):
            assert torch.allclose(got[:, :T], want[:, :T], atol=ATOL, rtol=0), report(got[:, :T], want[:, :T])


def test_a_slice_checks_its_rows_and_span():
    m = tiny_model("llama")
    prompt = FusedPrompt([Segment("suffix", torch.arange(1, 11))])
    cache = KVCache(m, 10)
    with pytest.raises(ValueError, match="uncached"):  # position 3 of the span has no cache
        fused_prefill(m, prompt, torch.tensor([0, 1, 2, 4]), kv_out=cache, span=(0, 5))
    with pytest.raises(ValueError, match="within"):
        fused_prefill(m, prompt, torch.arange(10), kv_out=cache, span=(0, 11))
    with pytest.raises(ValueError, match="kv_out"):
        fused_prefill(m, prompt, torch.arange(5), span=(0, 5))


# ---------------------------------------------------------------------- the scheduler's steps

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(4)]
QUESTIONS = [f"Which document mentions word{i}x{i + 3}?" for i in range(4)]
BUDGET = 32  # step_prefill_tokens: every prompt here is several slices


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _engine(tiny, **cfg) -> QCFuseEngine:
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=engine_config(**cfg))
    eng.build_chunks(DOCS)
    return eng


@pytest.mark.parametrize("method", ["full", "qcfuse", "cacheblend"])
def test_a_chunked_answer_is_the_unchunked_one(tiny, method):
    """fp32: prompts prefilled in slices of 32 rows answer token for token as prefilled whole
    (cacheblend chooses its rows during the prefill: it is not sliced, and still answers)."""
    whole, chunked = _engine(tiny), _engine(tiny, step_prefill_tokens=BUDGET)
    for i, q in enumerate(QUESTIONS):
        docs = DOCS[i:] + DOCS[:i]
        want = whole.answer(q, docs, method=method, ratio=0.3, max_new_tokens=6)
        got = chunked.answer(q, docs, method=method, ratio=0.3, max_new_tokens=6)
        assert got.token_ids == want.token_ids
        assert got.recomputed_tokens == want.recomputed_tokens
        assert torch.allclose(got.first_logits, want.first_logits, atol=ATOL, rtol=0)
    assert whole.stats().scheduler.prefill_slices == 0
    slices = chunked.stats().scheduler.prefill_slices
    assert slices == 0 if method == "cacheblend" else slices >= 2 * len(QUESTIONS)


def test_chunked_and_batched_is_alone_bit_for_bit_in_deterministic_mode(tiny):
    """Deterministic mode: requests sliced and decoded together give the bits of each alone
    (a request's slices depend on its rows and the budget only)."""
    reqs = [(q, DOCS[i:] + DOCS[:i], ("full", "qcfuse")[i % 2]) for i, q in enumerate(QUESTIONS * 2)]
    alone = _engine(tiny, deterministic=True, step_prefill_tokens=BUDGET)
    want = [alone.answer(q, d, method=m, ratio=0.3, max_new_tokens=32, ignore_eos=True) for q, d, m in reqs]
    eng = _engine(tiny, deterministic=True, step_prefill_tokens=BUDGET)
    streams = [eng.stream(q, d, method=m, ratio=0.3, max_new_tokens=32, ignore_eos=True) for q, d, m in reqs]
    for s in streams:
        list(s)
    got = [s.result for s in streams]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and torch.equal(g.first_logits, w.first_logits)
    s = eng.stats().scheduler
    assert s.max_batch_seen > 1 and s.prefill_slices >= 2 * len(reqs)


def test_a_long_prompt_does_not_stop_the_running_answers(tiny):
    """A request decoding gets a token in every scheduler step while a long prompt arriving
    behind it is prefilled over several steps, at most `step_prefill_tokens` rows a step."""
    eng = _engine(tiny, step_prefill_tokens=BUDGET)
    sched = eng._scheduler  # the engine's; its steps are counted (not timed)
    steps: list[dict] = []
    real_step, real_take, real_run = sched.step, sched._take_tokens, sched._run

    def take(batch, rows):
        steps[-1]["decoded"] += [j.request.generation.max_new_tokens for j in batch]
        return real_take(batch, rows)

    def run(job, rows):
        steps[-1]["slices"].append((job.request.generation.max_new_tokens, rows))
        return real_run(job, rows)

    def step():
        steps.append({"decoded": [], "slices": []})
        real_step()

    sched.step, sched._take_tokens, sched._run = step, take, run
    running = eng.stream(QUESTIONS[0], DOCS[:1], method="full", max_new_tokens=40, ignore_eos=True)
    long = eng.stream(QUESTIONS[1], DOCS, method="full", max_new_tokens=3, ignore_eos=True)
    list(long)
    list(running)
    assert running.result is not None and long.result is not None
    assert long.result.prompt_tokens > 4 * BUDGET
    # from the running request's first decode step to the long prompt's last slice
    first = next(i for i, s in enumerate(steps) if 40 in s["decoded"])
    last = max(i for i, s in enumerate(steps) if any(n == 3 for n, _ in s["slices"]))
    spans = [s for s in steps[first : last + 1] if any(n == 3 for n, _ in s["slices"])]
    assert len(spans) >= 4  # the long prefill spans several steps ...
    for s in steps[first : last + 1]:  # ... and the running request decodes in every one
        assert 40 in s["decoded"]
        assert sum(rows for _, rows in s["slices"]) <= BUDGET
    alone = _engine(tiny).answer(QUESTIONS[0], DOCS[:1], method="full", max_new_tokens=40, ignore_eos=True)
    assert running.result.token_ids == alone.token_ids
