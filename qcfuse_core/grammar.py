"""JSON-schema constrained decoding: llguidance's token mask in our sampler.

    json_schema_constraint(tokenizer, schema) -> a factory of per-request `Constraint`s
                                                (generation.py), set as
                                                GenerationConfig(constraint=...)

The grammar engine is llguidance (Microsoft's Rust Earley parser behind Guidance; a 3 MB
wheel with no dependencies): it compiles the schema once per (tokenizer, schema) and gives,
at every step, the bitmask of tokens that keep the output a valid prefix of a JSON value
matching the schema. We only apply the mask; we do not parse grammars ourselves. Optional
extra: pip install 'qcfuse[structured]'.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

STRUCTURED_PIP = "pip install 'qcfuse[structured]'"


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as e:
        raise ImportError(f"structured output needs llguidance; install it with:\n    {STRUCTURED_PIP}") from e
    return llguidance


# compact one-line JSON (a model is free to emit whitespace forever otherwise); keywords the
# compiler does not implement (pydantic's titles, descriptions) are ignored
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer):
    """llguidance's view of a HF fast tokenizer, built once per tokenizer (it walks the vocabulary)."""
    llg = _llguidance()
    with _LOCK:
        got = _TOKENIZERS.get(tokenizer)
        if got is None:
            got = _TOKENIZERS[tokenizer] = llg.hf.from_tokenizer(tokenizer)
        return got


class JsonSchemaConstraint:
    """One request's matcher: the tokens allowed next, advanced by every accepted token."""

    def __init__(self, ll_tokenizer, grammar: str) -> None:
        llg = _llguidance()
        self._torch = llg.torch
        self.matcher = llg.LLMatcher(ll_tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(f"the JSON schema cannot be compiled: {self.matcher.get_error()}")
        self._mask = llg.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)  # (1, ceil(V/32)) int32

    def allowed(self, vocab_size: int) -> torch.Tensor:
        self._torch.fill_next_token_bitmask(self.matcher, self._mask, 0)
        bits = self._mask[0]
        # int32 words -> bits, little end first: token t is bit t % 32 of word t // 32
        shifts = torch.arange(32, dtype=torch.int32)
        full = ((bits[:, None] >> shifts) & 1).reshape(-1).bool()
        out = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, full.numel())
        out[:n] = full[:n]
        return out

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(int(token_id)):
            raise RuntimeError(f"token {token_id} violates the JSON schema: {self.matcher.get_error()}")

    def is_finished(self) -> bool:
        return self.matcher.is_accepting() and not self._more_allowed()

    def _more_allowed(self) -> bool:
        """Whether anything but end-of-sequence may still follow (an accepting state can allow
        more, e.g. digits after `1`)."""
        self._torch.fill_next_token_bitmask(self.matcher, self._mask, 0)
        eos = self.matcher_eos
        bits = self._mask[0].clone()
        if eos is not None:
            bits[eos // 32] &= ~(1 << (eos % 32))
        return bool(bits.any())

    matcher_eos: int | None = None


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties
    and says nothing else (as OpenAI's strict mode): a model may not pad the answer with keys
    the caller's class would drop, running out of tokens before the JSON closes."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: ({name: closed(sub) for name, sub in v.items()} if k in ("properties", "$defs", "definitions")
               and isinstance(v, Mapping) else closed(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema_constraint(tokenizer, schema: Mapping[str, Any] | None) -> Callable[[], JsonSchemaConstraint]:
    """A factory of fresh constraints for `schema` (None: any JSON object), for this tokenizer."""
    llg = _llguidance()
    if schema is not None and not isinstance(schema, Mapping):
        raise TypeError(f"schema must be a JSON-schema dict, got {type(schema).__name__}")
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema) if schema else {"type": "object"}),
                                                     defaults=JSON_STYLE)
    err = llg.LLMatcher.validate_grammar(grammar)
    if err:
        raise ValueError(f"the JSON schema cannot be compiled: {err}")
    ll_tok = _ll_tokenizer(tokenizer)
    eos = ll_tok.eos_token

    def make() -> JsonSchemaConstraint:
        c = JsonSchemaConstraint(ll_tok, grammar)
        c.matcher_eos = eos
        return c

    return make
