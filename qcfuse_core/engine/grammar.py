"""JSON-schema constrained decoding: llguidance's token mask in our sampler.

    json_schema_constraint(tokenizer, schema) -> a factory of per-request `Constraint`s
                                                (generation.py), set as
                                                GenerationConfig(constraint=...)

The grammar engine is llguidance (Microsoft's Rust Earley parser behind Guidance; a 3 MB
wheel with no dependencies): it compiles the schema once per (tokenizer, schema) and gives,
at every step, the bitmask of tokens that keep the output a valid prefix of a JSON value
matching the schema. We only apply the mask; we do not parse grammars ourselves. Optional
extra: pip install 'qcfuse[structured]'.

A mask keeps the output valid, not finished: a small model under a schema can loop inside a
string until the token limit. `RepetitionGuard` rejects a token that would repeat an earlier
stretch of string text (the sampler then takes the next best allowed token), so strings end
and the object closes; the schema's `maxItems` / `maxLength` bound lists and strings.

Limits, checked when a schema is compiled (a schema is a client's input; each limit is a
ValueError, a 400 in the server, never a crash mid-answer):

    depth      the schema document nests at most MAX_SCHEMA_DEPTH objects and lists inside
               each other (deeper ones exhausted Python's recursion here)
    recursion  a `$ref` whose every expansion must contain itself again (`{"$ref": "#"}`
               under a required property) forces an endless output: llguidance's parser
               runs out of items on the first token. A fresh matcher's forced output is
               computed once; more than MAX_FORCED_BYTES of it is refused. A recursive
               schema with a way out (an optional property, an array that may be empty,
               another anyOf branch) forces nothing endless and passes
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


REPEAT_CHARS = 24  # the repetition guard's span: string text repeating this many characters
MAX_SCHEMA_DEPTH = 64  # objects and lists nested in a schema document, at most
MAX_FORCED_BYTES = 4096  # output a schema may force before the model chooses anything


def schema_depth(schema: Any) -> int:
    """How deep `schema`'s objects and lists nest (a scalar: 0; `{}`: 1), walked without
    recursion, so any depth a JSON parser handed over is measured."""
    deepest, todo = 0, [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in children)
    return deepest


class RepetitionGuard:
    """Keeps a JSON output's strings from looping (a small model's failure under a schema:
    "a cat is a cat, and a cat is a cat, ..." until the token limit, the object never closed;
    a list padded with copies of its first item).

    It follows the JSON text token by token (inside a string or not, escapes) and keeps
    the strings' contents joined by a separator. A token is rejected when it is inside a
    string and would make those contents end with a span of `span` characters that occurred
    before - a repeat of an earlier stretch of string text, in this string or an earlier
    one. A token that closes the string is never rejected: closing is the way out of a loop.
    Structure outside strings (keys' punctuation, `}, {`) repeats legitimately and is not
    looked at.

        contents: "a cat is a cat, and a cat is a cat, and |a"     (span 24)
                   ^^^^^^^^^^^^^^^^^^^^^^^^ occurred before -> "a" rejected; the sampler takes
                   the next best token ('"' closes the string)
    """

    def __init__(self, token_text: Callable[[int], str], span: int = REPEAT_CHARS) -> None:
        if span < 2:
            raise ValueError(f"span must be >= 2 characters, got {span}")
        self.token_text, self.span = token_text, span
        self.in_string = self.escaped = False
        self.contents = ""  # every string's characters so far, strings separated by "\x00"

    def _advance(self, text: str) -> tuple[str, bool, bool, bool]:
        """(the string characters `text` adds, in_string after, escaped after, closes a string)."""
        added, inside, esc, closes = [], self.in_string, self.escaped, False
        for ch in text:
            if not inside:
                if ch == '"':
                    inside = True
                continue
            if esc:
                esc = False
                added.append(ch)
            elif ch == "\\":
                esc = True
                added.append(ch)
            elif ch == '"':
                inside, closes = False, True
                added.append("\x00")
            else:
                added.append(ch)
        return "".join(added), inside, esc, closes

    def rejects(self, token_id: int) -> bool:
        added, _, _, closes = self._advance(self.token_text(token_id))
        if closes or not added:
            return False
        text, n = self.contents + added, self.span
        for end in range(max(len(self.contents) + 1, n), len(text) + 1):
            if text.find(text[end - n : end], 0, end - 1) != -1:
                return True
        return False

    def accept(self, token_id: int) -> None:
        added, self.in_string, self.escaped, _ = self._advance(self.token_text(token_id))
        self.contents += added


class JsonSchemaConstraint:
    """One request's matcher: the tokens allowed next, advanced by every accepted token;
    with a `RepetitionGuard`, allowed tokens that would loop inside a string are rejected."""

    def __init__(self, ll_tokenizer, grammar: str, guard: RepetitionGuard | None = None) -> None:
        llg = _llguidance()
        self._torch = llg.torch
        self.matcher = llg.LLMatcher(ll_tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(f"the JSON schema cannot be compiled: {self.matcher.get_error()}")
        self._mask = llg.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)  # (1, ceil(V/32)) int32
        self.guard = guard

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
        if self.guard is not None:
            self.guard.accept(token_id)

    def rejects(self, token_id: int) -> bool:
        """An allowed token the repetition guard would rather not take (the sampler picks the
        next best); never one that closes a string."""
        return self.guard is not None and self.guard.rejects(token_id)

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
    out = {
        k: (
            {name: closed(sub) for name, sub in v.items()}
            if k in ("properties", "$defs", "definitions") and isinstance(v, Mapping)
            else closed(v)
        )
        for k, v in schema.items()
    }
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _check_forced(ll_tok, grammar: str) -> None:
    """ValueError where the grammar forces an endless output from its start (module docstring:
    recursion): what a fresh matcher must emit before any choice, computed once."""
    probe = _llguidance().LLMatcher(ll_tok, grammar, log_level=0)
    forced = probe.compute_ff_bytes()
    if probe.is_error() or len(forced) > MAX_FORCED_BYTES:
        raise ValueError(
            "the JSON schema recurses without end: a $ref must be followed into itself again at every "
            f"level (it forces over {MAX_FORCED_BYTES} bytes of output before the model chooses anything); "
            "give the recursion a way out (an optional property, an array that may be empty, another anyOf branch)"
        )


def json_schema_constraint(
    tokenizer, schema: Mapping[str, Any] | None, *, repeat_chars: int | None = REPEAT_CHARS
) -> Callable[[], JsonSchemaConstraint]:
    """A factory of fresh constraints for `schema` (None: any JSON object), for this tokenizer.

    The schema's `maxItems`, `maxLength` (and `minItems`, `minLength`, enums, ...) are part of
    the grammar: llguidance never allows a token past them. repeat_chars: the repetition
    guard's span (`RepetitionGuard`); None turns the guard off."""
    llg = _llguidance()
    if schema is not None and not isinstance(schema, Mapping):
        raise TypeError(f"schema must be a JSON-schema dict, got {type(schema).__name__}")
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema nests {depth} levels deep, over the limit of {MAX_SCHEMA_DEPTH}")
    if repeat_chars is not None and (
        isinstance(repeat_chars, bool) or not isinstance(repeat_chars, int) or repeat_chars < 2
    ):
        raise ValueError(f"repeat_chars must be an int >= 2 or None, got {repeat_chars!r}")
    grammar = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(closed(schema) if schema else {"type": "object"}), defaults=JSON_STYLE
    )
    err = llg.LLMatcher.validate_grammar(grammar)
    if err:
        raise ValueError(f"the JSON schema cannot be compiled: {err}")
    ll_tok = _ll_tokenizer(tokenizer)
    _check_forced(ll_tok, grammar)
    eos = ll_tok.eos_token

    texts: dict[int, str] = {}  # token id -> its text, decoded once per factory

    def token_text(token_id: int) -> str:
        got = texts.get(token_id)
        if got is None:
            got = texts[token_id] = tokenizer.decode([token_id])
        return got

    def make() -> JsonSchemaConstraint:
        guard = RepetitionGuard(token_text, repeat_chars) if repeat_chars is not None else None
        c = JsonSchemaConstraint(ll_tok, grammar, guard)
        c.matcher_eos = eos
        return c

    return make
