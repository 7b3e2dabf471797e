"""JSON-schema constrained decoding (qcfuse_core/engine/grammar.py): the mask llguidance computes,
applied by our sampler, makes even a random model's output parse against the schema."""

from __future__ import annotations

import json

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.generation import GenerationConfig, Sampler
from qcfuse_core.engine.grammar import MAX_SCHEMA_DEPTH, closed, json_schema_constraint, schema_depth
from qcfuse_core.model.testing import byte_tokenizer, tiny_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "colour": {"enum": ["red", "green", "blue"]},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["ok", "colour", "tags"]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_model_under_the_schema_emits_valid_json(seed):
    eng = QCFuseEngine(tiny_model("llama", tokenizer=True, seed=seed))
    c = json_schema_constraint(eng.tokenizer, SCHEMA)
    r = eng.complete("Answer as JSON.", method="full", max_new_tokens=120, temperature=1.0, seed=seed,
                     constraint=c)
    obj = json.loads(r.text)
    assert r.finish_reason == "stop", r.text  # the grammar closed, then only EOS was allowed
    assert set(obj) == {"ok", "colour", "tags"} and isinstance(obj["ok"], bool)
    assert obj["colour"] in ("red", "green", "blue") and set(obj["tags"]) <= {"a", "b"}


def test_the_mask_forbids_what_the_schema_forbids():
    tok = byte_tokenizer()
    c = json_schema_constraint(tok, {"type": "boolean"})()
    allowed = c.allowed(256)
    assert allowed[ord("t")] and allowed[ord("f")] and not allowed[ord("{")] and not allowed[ord("1")]
    sampler = Sampler(GenerationConfig(constraint=lambda: c), eos=[0])
    logits = torch.zeros(256)
    logits[ord("x")] = 10.0  # the model prefers a forbidden token
    assert chr(sampler(logits)) in "tf"


def test_closed_schema_adds_no_properties_and_keeps_names():
    got = closed({"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}}})
    assert got["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]  # a field named "properties" is a field
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert closed({"type": "object", "additionalProperties": True, "properties": {}})["additionalProperties"] is True


def test_bad_schema_raises():
    with pytest.raises(TypeError, match="JSON-schema dict"):
        json_schema_constraint(byte_tokenizer(), "not a schema")


def _nested(levels: int) -> dict:
    """An object schema `levels` objects deep (issue 62's N-V8 used 400)."""
    root = node = {"type": "object", "properties": {}}
    for _ in range(levels - 1):
        node["properties"]["a"] = node = {"type": "object", "properties": {}}
    return root


def test_a_schema_past_the_depth_limit_is_refused_not_a_recursion_error():
    assert schema_depth(_nested(3)) == 6 and schema_depth({}) == 1 and schema_depth(True) == 0
    assert schema_depth(_nested(5000)) == 10000  # measured without recursion
    with pytest.raises(ValueError, match=f"nests 800 levels deep, over the limit of {MAX_SCHEMA_DEPTH}"):
        json_schema_constraint(byte_tokenizer(), _nested(400))
    json_schema_constraint(byte_tokenizer(), _nested(MAX_SCHEMA_DEPTH // 2))()  # at the limit: compiles


def test_a_schema_that_recurses_without_end_is_refused_and_one_with_a_way_out_compiles():
    """N-V9: a forced tool call whose parameters are {"$ref": "#"} forces
    {"name": "f", "arguments": {"name": "f", ... without end; llguidance ran out of items on
    the first token. A recursive schema with an optional way out compiles and decodes."""
    from typing import Optional

    from pydantic import BaseModel

    from qcfuse_core.engine.chat import tool_call_schema

    endless = tool_call_schema([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}])
    for schema in (endless, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}):
        with pytest.raises(ValueError, match="recurses without end"):
            json_schema_constraint(byte_tokenizer(), schema)

    class Node(BaseModel):
        name: str
        children: list["Node"] = []
        parent: Optional["Node"] = None

    eng = QCFuseEngine(tiny_model("llama", tokenizer=True, seed=4))
    c = json_schema_constraint(eng.tokenizer, Node.model_json_schema())
    r = eng.complete("Answer as JSON.", method="full", max_new_tokens=160, temperature=1.0, seed=4, constraint=c)
    assert r.text.startswith('{"name": "')  # decoding went on past the first token


def test_missing_llguidance_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=r"pip install 'qcfuse\[structured\]'"):
        json_schema_constraint(byte_tokenizer(), {"type": "boolean"})


# ---------------------------------------------------------------------- the repetition guard (issue 40, item 5)


def _guard(text: str, span: int = 8):
    from qcfuse_core.engine.grammar import RepetitionGuard

    g = RepetitionGuard(chr, span)
    for ch in text:
        g.accept(ord(ch))
    return g


def test_the_guard_rejects_a_repeat_inside_strings_only():
    g = _guard('{"s": "abcdefgh, abcdefg')
    assert g.rejects(ord("h"))  # "abcdefgh" again: a repeat of 8 characters
    assert not g.rejects(ord("x")) and not g.rejects(ord('"'))  # new text; closing is always allowed
    outside = _guard('{"a": 1, "b": 2}, {"a": 1, "b": 2}')  # structure repeats freely
    assert not outside.in_string and not outside.rejects(ord(","))
    items = _guard('["abcdefgh", "abcdefg')  # a list item copying an earlier one
    assert items.rejects(ord("h"))
    escaped = _guard('{"s": "a\\"bcdefgh a\\"bcdefg')  # an escaped quote stays inside the string
    assert escaped.in_string and escaped.rejects(ord("h"))


def test_max_items_and_max_length_are_honoured():
    tok = byte_tokenizer()
    for schema, text, stop in [
        ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["a"]}, '{"a": ["x", "y"', ","),
        ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]},
         '{"s": "abc', "d"),
    ]:
        c = json_schema_constraint(tok, schema)()
        for ch in text:
            assert c.allowed(256)[ord(ch)], (text, ch)
            c.accept(ord(ch))
        assert not c.allowed(256)[ord(stop)]  # a third item, a fourth character: not allowed


def test_bad_repeat_span_raises():
    with pytest.raises(ValueError, match="repeat_chars must be an int >= 2 or None"):
        json_schema_constraint(byte_tokenizer(), {"type": "string"}, repeat_chars=1)
