"""Content-addressed segmentation: finding registered chunk texts inside prompts."""

from __future__ import annotations

from qcfuse_core.retrieval.texts import ANCHOR, ChunkTextIndex

A = "Port Halden is a small harbour town on the northern coast of the island of Veloria."
B = "The Zephyr Institute is a marine research station in Port Halden, founded in 1987."
A_LONGER = A + " About twelve thousand people live there."


def test_finds_texts_in_order_and_skips_the_rest():
    idx = ChunkTextIndex()
    idx.add(A, "a")
    idx.add(B, "b")
    prompt = f"Context:\n{B}\n\n{A}\nQuestion: where?"
    assert [(p.text, p.node_id) for p in idx.find(prompt)] == [(B, "b"), (A, "a")]
    assert idx.find("nothing known here " * 5) == []


def test_longest_match_wins_and_matches_do_not_overlap():
    idx = ChunkTextIndex()
    idx.add(A, "short")
    idx.add(A_LONGER, "long")
    assert [p.node_id for p in idx.find("x " + A_LONGER + " y")] == ["long"]
    assert [p.node_id for p in idx.find(A + A)] == ["short", "short"]


def test_short_texts_are_not_indexed_and_ids_can_be_overridden():
    idx = ChunkTextIndex()
    assert not idx.add("x" * (ANCHOR - 1))
    idx.add(A)
    assert idx.find(A, node_ids={A: "from-postprocessor"})[0].node_id == "from-postprocessor"


def test_two_instances_on_one_file_see_each_others_texts(tmp_path):
    one, two = ChunkTextIndex(tmp_path / "t.sqlite"), ChunkTextIndex(tmp_path / "t.sqlite")
    assert two.find(A) == []  # builds two's table
    one.add(A, "a")
    assert [p.node_id for p in two.find(A)] == ["a"]
    assert len(two) == 1


def test_split_prompt_layout_with_and_without_a_frame():
    from qcfuse_core.retrieval.texts import split_prompt
    from qcfuse_core.types import Piece

    a, b = Piece("chunk", A, "a"), Piece("chunk", B, "b")
    got = split_prompt(f"Ctx: {A}\n\n{B} Q?", [a, b], head="<h>", tail="<t>")
    assert [(p.kind, p.text) for p in got] == [("prefix", "<h>Ctx: "), ("chunk", A), ("text", "\n\n"),
                                               ("chunk", B), ("suffix", " Q?<t>")]
    assert [p.kind for p in split_prompt(A + B, [a, b])] == ["chunk", "chunk"]  # nothing around them
    assert [p.kind for p in split_prompt("just a question", [], head="<h>")] == ["prefix", "suffix"]
