"""Device-side sampling (engine/ahead.py, `ModelRunner.launch`): a decode step's greedy tokens
chosen on the device and fed to the next step there, read back one step late - the same
tokens as the host's argmax, token for token, and stops (end of sequence, stop strings,
max_new_tokens) as exact. CPU: the eager step stands in for the graph (the feed and the
read-back are the same code); tests/test_gpu_decode_ahead.py runs the graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.engine import pipeline
from qcfuse_core.model.runner import ModelRunner
from qcfuse_core.model.testing import tiny_model
from tests.qc_fixtures import _caches, _copy, docs_engine, hold_worker

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(10)) for i in range(4)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def test_launch_feeds_the_previous_steps_tokens(tiny):
    """Three sequences of different lengths, five steps, the batch reordered and cut between
    steps: each fed row's input is its previous greedy token, and the logits and tokens equal
    decode + the host's argmax."""
    runner, host = ModelRunner(tiny), ModelRunner(tiny)
    with torch.inference_mode():
        base = _caches(tiny, (5, 17, 9), room=8)
        mine, theirs = [_copy(c) for c in base], [_copy(c) for c in base]
        order = [0, 1, 2]
        first = [3, 100, 7]
        launched = runner.launch([mine[i] for i in order], first)
        want = host.argmax(list(host.decode([theirs[i] for i in order], first)))
        assert launched.tokens() == want
        last = dict(zip(order, want))  # each sequence's latest token
        for nxt in ([2, 0, 1], [1, 2], [0, 1, 2], [2, 1]):
            # a row of the step before is fed on the device (its host token a placeholder);
            # sequence 0, left out of one step, comes back with its token from the host
            feed = [order.index(i) if i in order else -1 for i in nxt]
            tokens = [0 if f >= 0 else last[i] for i, f in zip(nxt, feed)]
            launched = runner.launch([mine[i] for i in nxt], tokens, feed)
            logits = host.decode([theirs[i] for i in nxt], [last[i] for i in nxt])
            assert torch.equal(launched.logits, logits)
            want = host.argmax(list(logits))
            assert launched.tokens() == want
            order = nxt
            last.update(zip(nxt, want))
        for a, b in zip(mine, theirs):
            assert a.length == b.length and torch.equal(a.k[:, : a.length], b.k[:, : b.length])


def test_feed_needs_a_launch_before(tiny):
    runner = ModelRunner(tiny)
    with torch.inference_mode():
        caches = _caches(tiny, (4,), room=3)
        with pytest.raises(ValueError, match="previous step to have been a launch"):
            runner.launch(caches, [1], [0])
        runner.launch(caches, [1])
        runner.decode(caches, [2])  # a plain step feeds nobody
        with pytest.raises(ValueError, match="previous step to have been a launch"):
            runner.launch(caches, [1], [0])


def _run(eng, reqs, together: bool):
    """reqs: (question, docs, keywords) -> each answer's (token ids, text, finish reason)."""
    if not together:
        results = [eng.answer(q, d, **kw) for q, d, kw in reqs]
    else:
        gate = hold_worker(eng)
        streams = [eng.stream(q, d, **kw) for q, d, kw in reqs]
        gate.set()
        results = []
        for s in streams:
            list(s)
            results.append(s.result)
    return [(r.token_ids, r.text, r.finish_reason) for r in results]


def _requests(stops: dict[int, str]):
    lengths = (3, 9, 5, 12, 7)
    return [
        (
            f"Which document mentions word{i}x{i + 2}?",
            DOCS[i % 4 :] + DOCS[: i % 4],
            dict(
                method="qcfuse" if i % 2 else "full",
                ratio=0.3,
                max_new_tokens=n,
                stop=(stops[i],) if i in stops else (),
            ),
        )
        for i, n in enumerate(lengths)
    ]


def _answers_agree(adapter, docs, make_reqs, monkeypatch, **cfg):
    """The host path's answers, then stops planted inside them (a stop string, an end-of-
    sequence token), then the same requests with decode_ahead: alone and batched, identical;
    and decode_ahead really launched steps ahead."""
    plain = docs_engine(adapter, docs, decode_ahead=False, **cfg)
    first = _run(plain, make_reqs({}), together=False)
    # a stop string inside answer 1's text, an EOS at answer 3's fourth token
    text1 = first[1][1]
    stops = {1: text1[len(text1) // 2 : len(text1) // 2 + 2]} if len(text1) >= 4 else {}
    eos = {first[3][0][3]} if len(first[3][0]) > 4 else set()
    real_eos = pipeline.eos_ids
    monkeypatch.setattr(pipeline, "eos_ids", lambda a: set(real_eos(a)) | eos)
    reqs = make_reqs(stops)
    want = _run(docs_engine(adapter, docs, decode_ahead=False, **cfg), reqs, together=False)
    finishes = [f for _, _, f in want]
    assert (not stops or finishes[1] == "stop") and (not eos or finishes[3] == "stop")
    launches = []
    real_launch = ModelRunner.launch
    monkeypatch.setattr(ModelRunner, "launch", lambda self, *a: launches.append(len(a[0])) or real_launch(self, *a))
    ahead = docs_engine(adapter, docs, decode_ahead=True, **cfg)
    assert _run(ahead, reqs, together=False) == want
    alone = len(launches)
    assert alone >= sum(len(t) - 1 for t, _, _ in want) - len(want)
    assert _run(ahead, reqs, together=True) == want
    assert max(launches[alone:]) == len(reqs)  # the batch shared its steps
    # rows computed ahead and dropped: at most one per request that stopped before its length
    extra = sum(launches[alone:]) - sum(len(t) - 1 + (f == "stop") for t, _, f in want)
    assert 0 <= extra <= sum(f == "stop" for _, _, f in want)
    return finishes


def test_answers_ahead_equal_the_host_path(tiny, monkeypatch):
    """Five greedy requests of different lengths (one stopped by a stop string, one by an end-
    of-sequence token, the rest by their lengths), alone and batched: token for token the
    host-argmax answers."""
    finishes = _answers_agree(tiny, DOCS, _requests, monkeypatch)
    assert finishes.count("stop") >= 2 and "length" in finishes  # the planted EOS may end others too


def test_deterministic_mode_answers_ahead_as_alone(tiny, monkeypatch):
    """The engine's deterministic mode (blocks of rows): the same bits alone and batched, ahead or not."""
    _answers_agree(tiny, DOCS, _requests, monkeypatch, deterministic=True)


def test_sampling_requests_stay_on_the_host_path(tiny, monkeypatch):
    """A batch with a temperature request runs plainly (its row sampled on the host) and every
    answer is the one-at-a-time answer."""
    reqs = [
        (q, d, {**kw, "temperature": 0.8 if i == 2 else 0.0, "seed": 5}) for i, (q, d, kw) in enumerate(_requests({}))
    ]
    want = _run(docs_engine(tiny, DOCS, decode_ahead=False), reqs, together=False)
    eng = docs_engine(tiny, DOCS, decode_ahead=True)
    assert _run(eng, reqs, together=True) == want


def test_embedded_model_answers_ahead_as_the_host_path(smol, monkeypatch):
    """The embedded SmolLM2-135M: greedy answers of different lengths (its own end of sequence
    ends most), alone and batched, token for token the host path's."""
    docs = [
        "The harbour of Velmora opens at dawn; its lighthouse keeper is Ana Ruiz.",
        "Velmora exports salt herring and tar; its bells ring at noon.",
        "The river Oss floods every spring and reaches the harbour in May.",
    ]

    def make(stops):
        qs = ("Who keeps the lighthouse?", "What does Velmora export?", "When does the river flood?")
        return [
            (q, docs, dict(method="qcfuse", ratio=0.3, max_new_tokens=n, stop=(stops[i],) if i in stops else ()))
            for i, (q, n) in enumerate(zip(qs + qs[:2], (4, 10, 6, 12, 8)))
        ]

    _answers_agree(smol, docs, make, monkeypatch)


def test_plan_feeds_only_the_jobs_of_the_step_ahead():
    """plan_ahead: a job of the step ahead is fed its row, a new one gives its host token, one
    whose pending token is its last sits out; with no job of the step ahead, no feed at all."""
    from types import SimpleNamespace as NS

    from qcfuse_core.engine.ahead import Ahead, plan_ahead

    def job(n_ids, max_new, token):
        return NS(decoding=NS(ids=[0] * n_ids, max_new=max_new, token=token))

    a, b, c, new = job(2, 9, 11), job(8, 9, 12), job(3, 9, 13), job(1, 9, 14)
    prev = Ahead([c, a, b], launched=None)  # type: ignore[arg-type]
    go, tokens, feed = plan_ahead([a, b, c, new], prev)
    assert go == [a, c, new] and feed == [1, 0, -1] and tokens[2] == 14  # b: 8 + 1 = its 9th token
    go, tokens, feed = plan_ahead([new], prev)
    assert go == [new] and tokens == [14] and feed is None
    assert plan_ahead([a], None)[2] is None
