"""Engine behaviour on the embedded model: generation, streaming, stops, results, caching."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.config import EngineConfig, FrameConfig
from qcfuse_core.engine.generation import GenerationConfig, Sampler, TextAssembler
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.types import ChunkKey, Piece

DOCS = [
    "The Zephyr Institute is a marine research station in Port Halden. It was founded in 1987 by the marine biologist Ada Ferreira.",
    "Cape Wrayth lighthouse stands on the northern tip of Veloria. The stone tower is thirty-two metres tall and was first lit in 1884.",
    "Halden Rovers is the football club of Port Halden. It was founded in 1911 and plays at Quayside Park.",
]
Q = "Who founded the Zephyr Institute?"


def test_full_recompute_through_fusion_answers_like_full(smol_engine):
    """ratio 1.0 recomputes every context token (the prefix cache is exact): same greedy answer as HF's prefill."""
    full = smol_engine.answer(Q, DOCS, method="full", max_new_tokens=24)
    fused = smol_engine.answer(Q, DOCS, method="random", ratio=1.0, max_new_tokens=24)
    assert fused.recomputed_tokens == fused.context_tokens
    assert fused.text == full.text and fused.token_ids == full.token_ids
    assert len(full.token_ids) > 3


def test_result_fields_and_cache_hits(smol):
    eng = QCFuseEngine(smol)  # a fresh engine (its own empty store) on the shared model
    first = eng.answer(Q, DOCS, method="naive", max_new_tokens=4)
    assert (first.cache_hits, first.cache_misses) == (0, 3)
    second = eng.answer(Q, DOCS[::-1], method="naive", max_new_tokens=4)  # other order: still hits
    assert (second.cache_hits, second.cache_misses) == (3, 0)
    r = second.to_dict()
    for key in ("answer", "ttft_ms", "total_ms", "method", "ratio", "context_tokens", "recomputed_tokens",
                "cache_hits", "cache_misses"):
        assert key in r
    assert 0 < second.ttft_ms <= second.total_ms
    assert second.method == "naive" and second.ratio is None
    glue = int(eng._steps.fuse_pieces(eng.frame.rag_pieces(Q, DOCS))[0].mask("text").sum())
    assert second.recomputed_tokens == glue
    assert second.context_tokens == second.prompt_tokens - len(eng.caches.tokenize(eng.frame.head + eng.config.frame.context_header)) - \
        len(eng.caches.tokenize(eng.config.frame.question_template.format(question=Q) + eng.frame.tail))


def test_streaming_deltas_join_to_text(smol_engine):
    stream = smol_engine.stream(Q, DOCS, method="epic", ratio=0.3, max_new_tokens=20)
    deltas = list(stream)
    assert stream.result is not None
    assert "".join(deltas) == stream.result.text
    assert len(deltas) > 1


def test_max_tokens_and_stop_strings(smol_engine):
    free = smol_engine.answer(Q, DOCS, method="full", max_new_tokens=24)
    capped = smol_engine.answer(Q, DOCS, method="full", max_new_tokens=3)
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"
    assert free.text.startswith(capped.text)
    words = free.text.split()
    stop = " " + words[3]
    stopped = smol_engine.answer(Q, DOCS, method="full", max_new_tokens=24, stop=(stop,))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]
    # streamed with the same stop: never emits any part of the stop string
    stream = smol_engine.stream(Q, DOCS, method="full", max_new_tokens=24, stop=(stop,))
    assert "".join(stream) == stopped.text


def test_eos_ends_generation(smol_engine):
    r = smol_engine.answer(Q, DOCS, method="full", max_new_tokens=64)
    assert r.finish_reason == "stop" and len(r.token_ids) < 64
    assert smol_engine.tokenizer.eos_token_id not in r.token_ids


def test_sampling_is_seeded(smol_engine):
    kw = dict(method="full", max_new_tokens=12, temperature=1.5, top_p=0.95)
    a = smol_engine.answer(Q, DOCS, seed=1, **kw)
    b = smol_engine.answer(Q, DOCS, seed=1, **kw)
    assert a.token_ids == b.token_ids
    others = {tuple(smol_engine.answer(Q, DOCS, seed=s, **kw).token_ids) for s in (2, 3, 4)}
    assert len(others | {tuple(a.token_ids)}) > 1


def test_sampler_top_k_1_is_greedy():
    logits = torch.randn(50)
    s = Sampler(GenerationConfig(temperature=0.8, top_k=1, seed=0))
    assert all(s(logits) == int(logits.argmax()) for _ in range(5))


def test_a_temperature_below_the_floor_is_greedy():
    """Issue 62's N-V3: temperature 1e-45 (inside the API's range) divided the logits to inf
    and the softmax to NaN; below TEMPERATURE_FLOOR the choice is the argmax."""
    from qcfuse_core.engine.generation import TEMPERATURE_FLOOR

    logits = torch.tensor([1.0, 3.0, 2.5, -1.0])
    for t in (1e-45, 5e-324, TEMPERATURE_FLOOR / 2):
        s = Sampler(GenerationConfig(temperature=t, top_p=0.9, seed=0))
        assert s.plain_greedy and all(s(logits) == 1 for _ in range(3))
    above = Sampler(GenerationConfig(temperature=TEMPERATURE_FLOOR, seed=0))
    assert not above.plain_greedy and above(logits) == 1  # sampled, and all but certain
    for bad in (float("nan"), float("inf"), -0.1):
        with pytest.raises(ValueError, match="temperature must be a number >= 0"):
            GenerationConfig(temperature=bad)


def test_sampler_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    s = Sampler(GenerationConfig(temperature=1.0, top_p=0.8, seed=0))
    assert {s(logits) for _ in range(200)} == {0, 1}


class _CharTokenizer:
    """Token id = a character's code point; decode joins them."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_assembler_holds_back_partial_stop_strings():
    asm = TextAssembler(_CharTokenizer(), stop=("END",))
    out = [asm.push(ord(c)) for c in "abcEN"]
    assert "".join(out) == "abc"  # "EN" may start "END": held back
    assert asm.push(ord("X")) == "ENX"
    assert [asm.push(ord(c)) for c in "END"][-1] == "" and asm.stopped
    assert asm.text == "abcENX"


def test_text_assembler_flushes_on_finish():
    asm = TextAssembler(_CharTokenizer(), stop=("STOP",))
    for c in "hiST":
        asm.push(ord(c))
    assert asm.text == "hi"
    assert asm.finish() == "ST" and asm.text == "hiST"


class _ByteTokenizer:
    """Token id = one byte; decode as a byte-level tokenizer does (invalid UTF-8 replaced)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_assembler_holds_an_unfinished_character_not_an_invalid_byte():
    """A character split over tokens is never emitted half (no replacement character that
    later turns into it), and an invalid byte holds the text back 3 tokens at most - not
    until the next valid character (a byte-level model with random weights writes few)."""
    asm = TextAssembler(_ByteTokenizer(), stop=())
    out = [asm.push(b) for b in "né".encode()]  # é is two bytes
    assert out == ["n", "", "é"]
    pushed = [0xFF, 0xFE] + [0x80] * 6  # bytes that never make a character
    out = [asm.push(b) for b in pushed]
    # settled 3 tokens behind, less the last replacement character there (it may be the start
    # of a character): from the 5th byte on, every byte lets one out
    assert out == [""] * 4 + ["\ufffd"] * 4
    assert asm.push(ord("x")) == "\ufffd" * 4 + "x" and asm.finish() == ""
    assert asm.text == _ByteTokenizer().decode(list("né".encode()) + pushed + [ord("x")])
    asm = TextAssembler(_ByteTokenizer(), stop=())
    emitted = "".join(asm.push(b) for b in [0xFF] + list("日本".encode())) + asm.finish()
    assert emitted == "\ufffd日本" and "\ufffd" not in asm.text[1:]  # 3-byte characters, never split


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                                 dict(stop="x"), dict(stop=("",))])
def test_generation_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        GenerationConfig(**bad)


def test_bad_requests_raise_clear_errors(smol_engine):
    with pytest.raises(ValueError, match="valid: .*full.*naive"):
        smol_engine.answer(Q, DOCS, method="magic")
    with pytest.raises(ValueError, match="ratio"):
        smol_engine.answer(Q, DOCS, ratio=1.5)
    with pytest.raises(ValueError, match="question is empty"):
        smol_engine.answer("  ", DOCS)
    with pytest.raises(ValueError, match="ratio"):
        EngineConfig(ratio=-0.1)


def test_complete_finds_registered_chunks_in_a_raw_prompt(smol):
    eng = QCFuseEngine(smol, text_index=ChunkTextIndex())
    for i, d in enumerate(DOCS):
        eng.build_chunks([d], [f"n{i}"])
    prompt = "Context information is below.\n---\n" + DOCS[2] + "\n\n" + DOCS[0] + "\n---\nQuery: " + Q + "\nAnswer: "
    pieces = eng.caches.texts.find(prompt)
    assert [p.node_id for p in pieces] == ["n2", "n0"]
    r = eng.complete(prompt, method="naive", max_new_tokens=4)
    assert (r.cache_hits, r.cache_misses) == (2, 0) and r.chunks == 2
    assert eng.caches.store.resolve("n2") == ChunkKey.for_tokens(eng.caches.fingerprint, eng.caches.tokenize(DOCS[2]))
    # the same text computed twice is stored once
    n = len(list(eng.caches.store.keys()))
    eng.build_chunks([DOCS[0]], ["other-id"])
    assert len(list(eng.caches.store.keys())) == n


def test_completion_pieces_layout(smol):
    eng = QCFuseEngine(smol)
    chunk = Piece("chunk", DOCS[1], "a")
    pieces = eng.frame.completion_pieces("HEAD " + DOCS[1] + " TAIL", [chunk])
    assert [p.kind for p in pieces] == ["prefix", "chunk", "suffix"]
    assert pieces[0].text.endswith("HEAD ") and pieces[2].text.startswith(" TAIL")
    no_chunks = eng.frame.completion_pieces("just a question", [])
    assert [p.kind for p in no_chunks] == ["prefix", "suffix"]
    with pytest.raises(ValueError, match="does not occur"):
        eng.frame.completion_pieces("unrelated", [chunk])


def test_frame_stops_follow_the_prompt_frame(smol_engine):
    """A chat template ends the model's turn: no stop strings. The plain frame of a base model
    (here a tiny model whose tokenizer has no chat template) stops where the frame's next
    question would start, following a custom question_template, or where it writes a second
    "Answer:" line (the frame's answer cue); an answer that runs into either label ends there."""
    from qcfuse_core.model.testing import tiny_model

    assert smol_engine.frame.stops == ()
    base = tiny_model("llama", tokenizer=True)
    assert not getattr(base.tokenizer, "chat_template", None)
    assert QCFuseEngine(base).frame.stops == ("\nQuestion:", "\nAnswer:")
    custom = QCFuseEngine(base, config=EngineConfig(frame=FrameConfig(question_template="\n\nQ: {question}\nA:")))
    assert custom.frame.stops == ("\nQ:", "\nAnswer:")
    plain = EngineConfig(frame=FrameConfig(question_template="{question}"))
    assert QCFuseEngine(base, config=plain).frame.stops == ("\nAnswer:",)
    asm = TextAssembler(base.tokenizer, QCFuseEngine(base).frame.stops)
    for t in base.tokenizer("Paris.\nQuestion: and", add_special_tokens=False).input_ids:
        asm.push(t)
    assert asm.stopped and asm.text == "Paris."
    asm = TextAssembler(base.tokenizer, QCFuseEngine(base).frame.stops)
    for t in base.tokenizer(" Paris.\nAnswer: Paris again", add_special_tokens=False).input_ids:
        asm.push(t)
        if asm.stopped:
            break
    assert asm.stopped and asm.text == " Paris."


def test_ignore_eos_decodes_to_max_new_tokens():
    """GenerationConfig.ignore_eos: end-of-sequence is a token like any other, so the answer
    runs to max_new_tokens (benchmarks); without it the same greedy token ends the answer."""
    from qcfuse_core.model.testing import tiny_model

    eng = QCFuseEngine(tiny_model("llama", tokenizer=True))
    docs = ["alpha beta gamma", "delta epsilon"]
    first = eng.answer("which?", docs, max_new_tokens=1).token_ids[0]
    eng.adapter.model.generation_config.eos_token_id = first  # the greedy first token is now EOS
    stopped = eng.answer("which?", docs, max_new_tokens=6)
    assert (stopped.token_ids, stopped.finish_reason) == ([], "stop")
    full = eng.answer("which?", docs, max_new_tokens=6, ignore_eos=True)
    assert len(full.token_ids) == 6 and full.token_ids[0] == first and full.finish_reason == "length"
    with pytest.raises(ValueError, match="ignore_eos"):
        GenerationConfig(ignore_eos="yes")  # type: ignore[arg-type]
