"""What goes over the wire: OpenAI's request bodies (the fields QCFuse honours), checked, and
the shapes of its responses, stream chunks and errors.

    POST /v1/chat/completions   ChatRequest        messages -> the model's chat template
    POST /v1/completions        CompletionRequest  prompt   -> the engine's completion frame
    POST /v1/chunks             ChunksRequest      texts (+ ids) -> chunk caches built

Both generation requests take `qcfuse: {documents | node_ids, method, ratio, ignore_eos}`
(clients send it through `extra_body`): the chunks of the prompt named explicitly instead of
found by content; `ignore_eos` is a benchmarking aid (every answer runs to max_tokens, as
vLLM's `ignore_eos`). Every string of a body must be valid Unicode (a lone surrogate escape
such as "\\ud800" is refused with a 400: no tokenizer can encode it).
Fields OpenAI defines that change the output and QCFuse cannot honour (n > 1, logprobs,
penalties, logit_bias, echo, best_of > 1, suffix) are refused with a 400 naming the field;
fields OpenAI does not define for the route are refused with a 400 naming them, as OpenAI
does (validation.py).

`usage.prompt_tokens_details.cached_tokens` (OpenAI's field, which ChatOpenAI reads into
`usage_metadata["input_token_details"]["cache_read"]`): the prompt tokens whose KV came from a
cache stored before the request - its chunks' and its prompt template's - less those
recomputed (`cached_tokens`). What the request computed is in the `qcfuse` field, never in
cached_tokens: `recomputed_tokens` (the rows selective recompute computed afresh) and
`built_tokens` (chunks that had no cache: computed in the request).

Errors, on every route and from every layer (the app, the shared middlewares, the replicas'
proxy), have one shape, OpenAI's: {"error": {"message", "type", "param", "code"}}, `code`
always a string - the request's own where there is one (`model_not_found`), else the
status's (`ERROR_CODES`: invalid_request, invalid_api_key, request_too_large, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qcfuse_core.serve.validation import unknown_fields
from qcfuse_core.types import FusionResult

ROLES = ("system", "developer", "user", "assistant", "tool")


ERROR_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "unavailable",
}


def error_code(status: int) -> str:
    """The string `code` of an error answered with `status` (module docstring)."""
    return ERROR_CODES.get(status, "server_error" if status >= 500 else "invalid_request")


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.status, self.param, self.code)


def error_body(message: str, kind: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; `code` the
    given one, else the status's (`error_code`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code or error_code(status)}}


class FusionOptions(BaseModel):
    """The request's `qcfuse` field: which chunks the prompt holds, and how to fuse them."""

    model_config = ConfigDict(extra="forbid")

    documents: list[str] | None = None  # at most ServeConfig.max_documents (checked by the app)
    node_ids: list[str] | None = None  # opaque keys: never part of a path
    method: str | None = None
    ratio: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool = False  # benchmarking: decode max_tokens tokens whatever the model ends with

    def count(self) -> int:
        return len(self.documents or self.node_ids or ())

    @model_validator(mode="after")
    def _one_channel(self) -> FusionOptions:
        if self.documents is not None and self.node_ids is not None:
            raise ValueError("pass documents or node_ids, not both")
        if any(not d for d in self.documents or ()) or any(not n for n in self.node_ids or ()):
            raise ValueError("documents and node_ids must be non-empty strings")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


def _lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in `value` (parsed JSON) holds a lone surrogate - JSON's
    "\\ud800" escape parses to one, and no text encoder takes it. Walked without recursion."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


class _Body(BaseModel):
    """A request body: every string in it valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        if _lone_surrogate(data):
            raise ValueError("the body holds a lone surrogate (an unpaired \\ud800-\\udfff escape): not valid Unicode")
        return data


class _Generation(_Body):
    """The sampling fields both routes share."""

    model_config = ConfigDict(extra="allow")
    route: ClassVar[str]  # "chat" or "completions": the fields OpenAI defines for it (validation.py)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's generator takes
    n: int | None = None
    qcfuse: FusionOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or ())
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def check_supported(self) -> None:
        """Refuse what would change the output and is not honoured (a 400 naming the field)."""
        unknown = unknown_fields(self.route, set(self.model_extra or {}))
        if unknown:
            raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])
        if self.n not in (None, 1):
            raise ApiError(400, f"n={self.n} is not supported: only n=1", param="n")
        extra = self.model_extra or {}
        unsupported = {
            "logprobs": lambda v: v not in (None, False),
            "top_logprobs": lambda v: v not in (None, 0),
            "logit_bias": lambda v: bool(v),
            "frequency_penalty": lambda v: v not in (None, 0, 0.0),
            "presence_penalty": lambda v: v not in (None, 0, 0.0),
            "best_of": lambda v: v not in (None, 1),
            "echo": lambda v: v not in (None, False),
            "suffix": lambda v: v not in (None, ""),
        }
        for name, bad in unsupported.items():
            if name in extra and bad(extra[name]):
                raise ApiError(400, f"{name}={extra[name]!r} is not supported by this server", param=name)


class ChatRequest(_Generation):
    route: ClassVar[str] = "chat"
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(msgs):
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
            m = {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")}
            m["role"] = "system" if role == "developer" else role
            m["content"] = _text_content(m.get("content"), i)
            out.append(m)
        return out

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(tools or ()):
            fn = t.get("function")
            if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        return tools

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens not in (None, self.max_tokens):
            raise ApiError(400, "max_tokens and max_completion_tokens differ; pass one", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def json_schema(self) -> tuple[bool, dict | None]:
        """(constrained, schema) of `response_format`: json_schema -> its schema, json_object
        -> any JSON object (None), text or absent -> unconstrained."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return False, None
        if fmt.get("type") == "json_object":
            return True, None
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema", param="response_format")
            return True, schema
        raise ApiError(
            400, "response_format.type must be one of text, json_object, json_schema", param="response_format"
        )


def _text_content(content: Any, i: int) -> str:
    """A message's content as text: a string, None (an assistant turn that only calls tools),
    or OpenAI's list of parts of which only `text` parts are accepted."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


class CompletionRequest(_Generation):
    route: ClassVar[str] = "completions"
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError(f"one prompt per request, got {len(v)}")
            v = v[0]
        if not v:
            raise ValueError("prompt is empty")
        return v

    def token_limit(self) -> int | None:
        return self.max_tokens


class ChunksRequest(_Body):
    model_config = ConfigDict(extra="forbid")

    texts: list[str] = Field(min_length=1, max_length=256)
    ids: list[str] | None = None

    @model_validator(mode="after")
    def _same_length(self) -> ChunksRequest:
        if self.ids is not None and len(self.ids) != len(self.texts):
            raise ValueError(f"ids ({len(self.ids)}) and texts ({len(self.texts)}) differ in length")
        if any(not t for t in self.texts):
            raise ValueError("texts must be non-empty")
        return self


# ---------------------------------------------------------------------------- responses

Kind = Literal["chat", "text"]


def new_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def fusion_stats(result: FusionResult, chunk_ids: list[str | None]) -> dict[str, Any]:
    """The response's `qcfuse` field: how the prompt's chunks were served."""
    return {
        "method": result.method,
        "ratio": result.ratio,
        "requested_method": result.requested_method,
        "answered": result.what_answered(),  # what answered and what the guard did, one line
        "ttft_ms": round(result.ttft_ms, 3),
        "total_ms": round(result.total_ms, 3),
        "chunks": result.chunks,
        "chunk_ids": chunk_ids,
        "cache_hits": result.cache_hits,
        "cache_misses": result.cache_misses,
        "cache_built": result.cache_built,
        "recomputed_tokens": result.recomputed_tokens,
        "built_tokens": built_tokens(result),
        "context_tokens": result.context_tokens,
        "recompute_share": round(result.recompute_share, 4),
        "chunk_sources": chunk_sources(result),
        "guard": result.guard.to_dict() if result.guard is not None else None,
        # the configuration used and this deployment's measured fidelity of it (engine/audit.py)
        "fidelity": result.fidelity,
    }


def chunk_sources(result: FusionResult) -> dict[str, int]:
    """How many of the prompt's chunk segments each tier served (gpu, host, disk: a stored
    image read) and how many were computed in the request (recomputed: a miss, full prefill,
    the planner's choice), from its load report; {} where the request read no tier (no load
    session: a store without tiers, full prefill)."""
    kinds = result.load.get("segment_sources") or []
    if len(kinds) != len(result.spans):
        return {}
    out = {"gpu": 0, "host": 0, "disk": 0, "recomputed": 0}
    for span, kind in zip(result.spans, kinds):
        if span.kind == "chunk":
            out[kind if kind in ("gpu", "host", "disk") else "recomputed"] += 1
    return out


def usage(result: FusionResult) -> dict[str, Any]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(result)},
    }


def cached_tokens(result: FusionResult) -> int:
    """Prompt tokens served from caches: those of the prefix and chunk segments whose cache was
    stored before the request (`PromptSpan.cache_hit`), less the rows selective recompute
    computed afresh. 0 for full prefill.

        prompt:    [prefix ✓][chunk A ✓][glue][chunk B ✗][suffix]     ✓ cache_hit
        rows:           ^       ^  ^            ^^^^        ^^^^      recomputed
        cached:    prefix + chunk A - its 3 recomputed rows
    """
    return _not_recomputed(result, [s for s in result.spans if s.cache_hit and s.kind in ("prefix", "chunk")])


def built_tokens(result: FusionResult) -> int:
    """Tokens of the prompt's chunk segments that had no cache before the request (chunk B
    above) and are not among the recomputed rows: computed in the request (the chunk's cache
    built then, or the chunk computed where it stands), never reused. With the recomputed
    rows and the cached tokens they make up the context:
    cached_tokens + recomputed_tokens + built_tokens == context_tokens (+ a cached prefix)."""
    return _not_recomputed(result, [s for s in result.spans if not s.cache_hit and s.kind == "chunk"])


def _not_recomputed(result: FusionResult, spans: list) -> int:
    """Tokens of `spans` outside the rows selective recompute computed afresh."""
    if not spans:
        return 0
    mask = torch.zeros(max(s.end for s in spans), dtype=torch.bool)
    for s in spans:
        mask[s.start : s.end] = True
    rows = result.selection.rows if result.selection is not None else None
    if rows is not None and rows.numel():
        rows = rows.detach().cpu()
        mask[rows[rows < mask.numel()]] = False
    return int(mask.sum())


def envelope(rid: str, kind: Kind, model: str, created: int, *, chunk: bool) -> dict[str, Any]:
    obj = {"chat": "chat.completion", "text": "text_completion"}[kind]
    return {
        "id": rid,
        "object": obj + (".chunk" if chunk and kind == "chat" else ""),
        "created": created,
        "model": model,
    }


def now() -> int:
    return int(time.time())
