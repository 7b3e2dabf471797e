"""What a request may say, as OpenAI checks it, and every refusal counted.

model ids      one public id (`ModelIds.public`, what /v1/models lists and answers carry):
               --model-name, else the packaged model's name the README uses
               ("SmolLM2-135M-Instruct"), else the model folder's name. Accepted as
               aliases: the folder's own name (a packaged model's carries a tag, e.g.
               "SmolLM2-135M-Instruct-e81ea92056") and the packaged key ("smollm2-135m").
               Any other id -> 404 `model_not_found`; a request without `model` gets the
               public one.
fields         the top-level fields OpenAI defines for each route (`CHAT_FIELDS`,
               `COMPLETION_FIELDS`) plus `qcfuse` and vLLM's `cache_salt` (app.py
               `tenant_of`); any other ("temprature") -> 400
               naming it, as OpenAI answers "Unrecognized request argument supplied".
               Known fields that would change the output and are not honoured are
               refused by protocol.py (`check_supported`); the rest are accepted and
               have no effect here (user, metadata, store, service_tier, ...).
StatusCounts   ASGI middleware, the app's outermost: every response's status by route,
               4xx and 5xx included (401 and 413 of the middlewares inside it too)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qcfuse_core.model.adapter import MODELS

CHAT_FIELDS = frozenset(
    {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
        "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
        "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
        "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options", "qcfuse",
        "cache_salt",
    }
)  # fmt: skip
COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
        "qcfuse", "cache_salt",
    }
)  # fmt: skip
_TAGGED = re.compile(r"^(?P<name>.+)-[0-9a-f]{6,}$")  # a packaged model's folder: <name>-<tag>


def unknown_fields(route: str, fields: set[str]) -> list[str]:
    """The fields of a body OpenAI does not define for `route` ("chat" or "completions")."""
    known = CHAT_FIELDS if route == "chat" else COMPLETION_FIELDS
    return sorted(fields - known)


@dataclass(frozen=True)
class ModelIds:
    """The ids a server answers to (module docstring)."""

    public: str
    aliases: frozenset[str] = frozenset()

    @classmethod
    def of(cls, adapter_name: str, model_name: str | None = None) -> ModelIds:
        """The ids of a model loaded from a folder named `adapter_name`, served as `model_name`
        (None: the README's name of a packaged model, else the folder's name)."""
        packaged = {m.name: key for key, m in MODELS.items()}
        tagged = _TAGGED.match(adapter_name)
        base = tagged.group("name") if tagged and tagged.group("name") in packaged else adapter_name
        public = model_name or base
        aliases = {adapter_name, base} | ({packaged[base]} if base in packaged else set())
        return cls(public, frozenset(aliases - {public}))

    def accepts(self, model: str | None) -> bool:
        return model is None or model == self.public or model in self.aliases

    def not_found(self, model: str) -> str:
        return f"The model `{model}` does not exist. This server serves `{self.public}` (GET /v1/models)."


def route_of(path: str) -> str:
    """The route label of a path in the metrics (a bounded set: unknown paths are "other")."""
    return {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/chunks": "chunks",
        "/v1/models": "models",
        "/health": "health",
        "/metrics": "metrics",
    }.get(path, "other")


class StatusCounts:
    """ASGI middleware: `count(route, status)` for every HTTP response that starts, and a 500
    for an exception that escapes the app before its response started (Starlette's outermost
    error middleware answers it, outside this one)."""

    def __init__(self, app: Any, count: Callable[[str, int], None]) -> None:
        self.app, self.count = app, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_of(scope.get("path", ""))
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.count(route, int(message["status"]))
            await send(message)

        try:
            return await self.app(scope, receive, counted)
        except Exception:
            if not started:
                self.count(route, 500)
            raise
