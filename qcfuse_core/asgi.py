"""The ASGI middlewares the HTTP apps share: `qcfuse serve` (serve/app.py) and `qcfuse studio`
(studio/app.py). Plain ASGI, no web framework imported here.

    JsonBodyLimit   a request whose body is not multipart (a JSON API) and is larger than
                    `limit` bytes gets a 413 - from its Content-Length before anything is
                    read, or once the bytes read pass the limit (a chunked body); the body
                    is replayed to the app otherwise
    BearerAuth      a request under `prefix` without `Authorization: Bearer <key>` gets a 401
                    (before its body is read); the key is compared in constant time
                    (`hmac.compare_digest`), so the time to refuse says nothing about how
                    much of it matched

Each app answers in its own error shape: it passes `error(status, message, headers)`, which
returns the ASGI response to send (the server: OpenAI's error body; the studio: its own).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]  # (scope, receive, send)
ErrorResponse = Callable[[int, str, dict[str, str]], ASGIApp]  # (status, message, headers) -> a response


class JsonBodyLimit:
    """ASGI middleware: a request whose body is not multipart and is larger than `limit`
    bytes gets a 413 (`error`), before the app sees it."""

    def __init__(self, app: ASGIApp, limit: int, *, error: ErrorResponse) -> None:
        self.app, self.limit, self.error = app, limit, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if headers.get(b"content-type", b"").startswith(b"multipart/"):  # uploads have their own limits
            return await self.app(scope, receive, send)
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            declared = 0
        if declared > self.limit:
            return await self._too_large(declared, scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                return await self._too_large(len(body), scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, n: int, scope, receive, send) -> None:
        msg = f"request body of {n:,} bytes is over the limit of {self.limit:,} bytes"
        await self.error(413, msg, {})(scope, receive, send)


class BearerAuth:
    """ASGI middleware: a request under `prefix` without `Authorization: Bearer <key>` gets a
    401 (`error`, with `WWW-Authenticate: Bearer`) before its body is read; other paths pass."""

    def __init__(self, app: ASGIApp, key: str, *, error: ErrorResponse, prefix: str = "/v1/") -> None:
        self.app, self.key, self.error, self.prefix = app, key.encode(), error, prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        msg = "missing API key: send 'Authorization: Bearer <key>'" if not header else "invalid API key"
        await self.error(401, msg, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
