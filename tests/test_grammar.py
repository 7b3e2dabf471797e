"""JSON-schema constrained decoding (qcfuse_core/grammar.py): the mask llguidance computes,
applied by our sampler, makes even a random model's output parse against the schema."""

from __future__ import annotations

import json

import pytest
import torch

from qcfuse_core.engine import QCFuseEngine
from qcfuse_core.generation import GenerationConfig, Sampler
from qcfuse_core.grammar import closed, json_schema_constraint
from qcfuse_core.testing import byte_tokenizer, tiny_model

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


def test_missing_llguidance_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=r"pip install 'qcfuse\[structured\]'"):
        json_schema_constraint(byte_tokenizer(), {"type": "boolean"})
