"""The retrieval learner (qcfuse_integrations/learning.py) and the shared base, on a tiny
model: texts learned from retrievals, renderings that differ, the miss counter, and an
engine serving concurrent callers without a lock."""

from __future__ import annotations

import threading

import pytest

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.testing import tiny_model
from qcfuse_integrations.base import GenerationOptions, check_options
from qcfuse_integrations.learning import Learner

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(14)) for i in range(3)]


@pytest.fixture
def engine():
    return QCFuseEngine(tiny_model("llama", tokenizer=True))


def test_retrieved_texts_are_built_in_the_background_and_found(engine):
    learner = Learner(engine)
    learner.see([(d, f"n{i}") for i, d in enumerate(DOCS)]).result()
    assert learner.counters()["background_builds"] == 3
    prompt = f"Context:\n{DOCS[2]}\n\n{DOCS[0]}\nQuestion: which?"
    m = learner.match(prompt)
    assert [(c.text, c.node_id) for c in m.chunks] == [(DOCS[2], "n2"), (DOCS[0], "n0")] and not m.unmatched
    r = engine.complete(prompt, m.chunks, method="qcfuse", max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (2, 0)


def test_renderings_that_differ_are_learned_under_their_ids_never_anothers(engine):
    learner = Learner(engine)
    learner.see([(d, f"n{i}") for i, d in enumerate(DOCS)], build=False)
    spaced = DOCS[1].replace(" ", "   ")  # other whitespace
    cut = DOCS[0][:80]  # truncated (spans of at least learning.MIN_SPAN characters count)
    header = "Source: a.md\n" + DOCS[2]  # a header before the verbatim text
    prompt = f"Context:\n{spaced}\n\n{cut}\n\n{header}\nQuestion?"
    m = learner.match(prompt)
    assert [c.node_id for c in m.chunks] == ["n1", "n0", "n2"] and m.learned == 3
    assert [c.text for c in m.chunks] == [spaced, cut, DOCS[2]]  # exactly the prompt's own text
    first = engine.complete(prompt, m.chunks, method="naive", max_new_tokens=1)
    assert first.cache_misses == 3  # computed now ...
    again = engine.complete(prompt, learner.match(prompt).chunks, method="naive", max_new_tokens=1)
    assert (again.cache_hits, again.cache_misses) == (3, 0)  # ... hits next time
    other = learner.match(f"Context:\n{'unrelated text ' * 30}\nQuestion?")  # pasted, never retrieved
    assert other.chunks == [] and other.unmatched and learner.counters()["unmatched_prompts"] == 1


def test_renderings_of_stored_texts_are_served_from_their_caches_then_built_whole(engine):
    learner = Learner(engine)
    paragraphs = [d.replace(": ", ":\n\n", 1) for d in DOCS[:2]]  # "Document i:\n\nword..."
    learner.see([(d, f"n{i}") for i, d in enumerate(paragraphs)]).result()
    squashed = " ".join(paragraphs[0].split())  # whitespace normalised
    cut = paragraphs[1][:90]  # truncated
    prompt = f"Context:\n{squashed}\n\n{cut}\nQuestion?"
    m = learner.match(prompt)
    assert [(c.text, c.node_id, c.source) for c in m.chunks] == [(squashed, "n0", paragraphs[0]),
                                                                 (cut, "n1", paragraphs[1])]
    assert m.renderings == [(squashed, "n0"), (cut, "n1")]
    first = engine.complete(prompt, m.chunks, method="naive", max_new_tokens=1)
    n = sum(int(engine.caches.chunk_tokens(t)[0].numel()) for t in (squashed, cut))
    assert first.cache_misses == 0 and first.cache_hits >= 2 and n - 4 <= first.subspan_tokens < n
    assert not any(engine.caches.store.contains(engine.caches.chunk_tokens(t)[1]) for t in (squashed, cut))  # nothing stored
    learner.build(m.renderings).result()  # what a call does after it served sub-spans
    again = engine.complete(prompt, learner.match(prompt).chunks, method="naive", max_new_tokens=1)
    assert (again.cache_hits, again.cache_misses, again.subspan_tokens) == (2, 0, 0)  # their own caches
    assert learner.counters()["background_builds"] == 4  # the two retrieved texts, then their renderings


def test_the_engine_serves_concurrent_callers_without_a_lock(engine):
    engine.build_chunks(DOCS, ["a", "b", "c"])
    questions = [f"Which document mentions word{i}x3?" for i in range(3)] * 2
    want = [engine.answer(q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=4).token_ids for q in questions]
    got: dict[int, list[int]] = {}
    barrier = threading.Barrier(len(questions))

    def ask(i: int) -> None:
        barrier.wait()
        got[i] = engine.answer(questions[i], DOCS, method="qcfuse", ratio=0.3, max_new_tokens=4).token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(questions))] == want


def test_generation_options_speak_the_frameworks_names():
    opts = GenerationOptions.resolve({"max_new_tokens": 64, "method": "qcfuse", "ratio": 0.15},
                                     {"max_tokens": 5, "top_p": 0.5, "stop": "END"})
    assert opts.generation.max_new_tokens == 5 and opts.generation.top_p == 0.5 and opts.generation.stop == ("END",)
    with pytest.raises(TypeError, match="not both"):
        GenerationOptions.resolve({}, {"max_tokens": 5, "max_new_tokens": 6})
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['n'\]; valid: a, b"):
        check_options({"n": 2}, ("b", "a"), "X")
    with pytest.raises(ValueError, match="ratio"):
        GenerationOptions.resolve({}, {"ratio": 2.0})


def test_a_list_repr_of_retrieved_texts_is_learned(engine):
    """LlamaIndex's simple_summarize pastes str(list of texts): newlines escaped."""
    learner = Learner(engine)
    texts = [DOCS[0] + "\n\n" + DOCS[1], DOCS[2] + "\nIt's the last one."]
    learner.see([(t, f"t{i}") for i, t in enumerate(texts)], build=False)
    prompt = f"Context information is below.\n{texts!s}\nQuery: which?"
    m = learner.match(prompt)
    assert [c.node_id for c in m.chunks] == ["t0", "t1"]
    assert [c.text for c in m.chunks] == [repr(t)[1:-1] for t in texts]


def test_the_latest_retrieval_names_a_text_seen_under_two_ids(engine):
    """The same text retrieved under another id while its first build is queued: both builds
    run (the second only links), and the content index names it by the later id."""
    learner = Learner(engine)
    learner.see([(DOCS[0], "old")])
    learner.see([(DOCS[0], "new")])
    learner.wait()
    assert [c.node_id for c in learner.match(f"Context:\n{DOCS[0]}\nQuestion?").chunks] == ["new"]
    assert learner.counters()["background_builds"] == 1  # computed once
