"""The ASGI middlewares the HTTP apps share: `qcfuse serve` (serve/app.py) and `qcfuse studio`
(studio/app.py). Plain ASGI, no web framework imported here.

    LocalOnly       the front door against DNS rebinding and cross-site requests (the way
                    Jupyter Server and Vite guard a local dev server): a `Host` that is not
                    the address the connection came in on, a localhost name or a configured
                    name gets a 403 (a page on evil.example that rebinds its name to
                    127.0.0.1 still sends `Host: evil.example`); a state-changing request
                    (not GET, HEAD, OPTIONS) whose `Origin` is not the server's own (or a
                    configured one) gets a 403 (browsers send `Origin` on every cross-origin
                    POST, multipart form uploads included). With `token`, state-changing
                    requests under `token_prefix` also need the per-process token, which the
                    server hands only to its own page, as a SameSite=Strict, HttpOnly cookie
                    on the page's responses (or sent as `X-QCFuse-Token`)
    BearerAuth      a request under `prefix` without `Authorization: Bearer <key>` gets a 401
                    (before its body is read); the key is compared in constant time
                    (`hmac.compare_digest`), so the time to refuse says nothing about how
                    much of it matched
    BodyLimit       a request body of any content type (JSON, multipart, anything) larger
                    than its route's limit gets a 413: from its Content-Length before a byte
                    is read, else as soon as the bytes streamed in pass the limit - the body
                    is passed through as it arrives, never buffered here, so a refused body
                    costs at most one limit's worth of memory

    AbortLog        a request the server cancels (uvicorn at the end of its shutdown grace
                    period, on SIGTERM) is one log line naming it, not a CancelledError
                    traceback; its response is ended (a stream cut short) or a 503

Order (outermost first): AbortLog, LocalOnly, BearerAuth, BodyLimit, the app - a foreign request is
refused before its key is checked, and a request without the key before its body is read.

Each app answers in its own error shape: it passes `error(status, message, headers)`, which
returns the ASGI response to send (the server: OpenAI's error body; the studio: its own).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]  # (scope, receive, send)
ErrorResponse = Callable[[int, str, dict[str, str]], ASGIApp]  # (status, message, headers) -> a response

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TOKEN_HEADER = "X-QCFuse-Token"


# ---------------------------------------------------------------------------- Host and Origin


def split_host(value: str) -> tuple[str, int | None]:
    """`Host` (or an origin's netloc) -> (lower-case name or address, port or None);
    '[::1]:8000' -> ('::1', 8000). Raises ValueError when malformed."""
    value = value.strip().lower()
    if not value or any(c in value for c in " /\\@"):
        raise ValueError(f"malformed host {value!r}")
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"malformed host {value!r}")
        port = rest[1:]
    elif value.count(":") == 1:
        name, port = value.split(":")
    elif ":" in value:  # an IPv6 address without brackets (no port)
        name, port = value, ""
    else:
        name, port = value, ""
    if port and not (port.isdigit() and int(port) <= 65535):
        raise ValueError(f"malformed port in {value!r}")
    return name.rstrip("."), int(port) if port else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _loopback_name(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost")


class LocalOnly:
    """ASGI middleware: the Host check, the Origin check of state-changing requests and
    (with `token`) the per-process token of the page's writes. See the module docstring.

    allowed_hosts: extra names (a leading '*.' matches any subdomain; '*' turns the Host
    check off, for a server behind a proxy that checks it). The connection's own local
    address (ASGI `scope["server"]`) and localhost names are always allowed.
    allowed_origins: extra origins ('https://app.example:8443') a browser page may write from.
    hints: what the refusals add on how to allow a name or an origin ({"host": ..., "origin": ...})."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        error: ErrorResponse,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        token: str | None = None,
        token_prefix: str = "/api/",
        cookie: str = "qcfuse_token",
        hints: Mapping[str, str] | None = None,
    ) -> None:
        self.app, self.error = app, error
        hosts = [h.strip().lower().rstrip(".") for h in allowed_hosts if h.strip()]
        self.any_host = "*" in hosts
        self.hosts = frozenset(h for h in hosts if not h.startswith("*"))
        self.suffixes = tuple(h[1:] for h in hosts if h.startswith("*."))
        self.origins = frozenset(o.strip().lower().rstrip("/") for o in allowed_origins if o.strip())
        self.token, self.token_prefix, self.cookie = (token.encode() if token else None), token_prefix, cookie
        self.hints = dict(hints or {})

    def host_allowed(self, name: str, server: tuple | None) -> bool:
        if self.any_host or _loopback_name(name) or name in self.hosts or name.endswith(self.suffixes or ("\0",)):
            return True
        local = str(server[0]).lower() if server else None
        if local is not None and name == local:
            return True
        # a literal address: allowed when it is the connection's own (above) or loopback while
        # the connection is (IPv4 and IPv6 spellings of one socket differ)
        if _is_ip(name) and local is not None and _is_ip(local):
            return ipaddress.ip_address(name).is_loopback and ipaddress.ip_address(local).is_loopback
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        raw_host = headers.get("host")  # absent: an HTTP/1.0 client, or an in-process call - never a browser
        try:
            name = split_host(raw_host)[0] if raw_host is not None else None
        except ValueError:
            return await self._refuse(400, f"malformed Host header {raw_host!r}", scope, receive, send)
        if name is not None and not self.host_allowed(name, scope.get("server")):
            return await self._refuse(
                403,
                f"Host {raw_host!r} is not this server's address or a localhost name (DNS rebinding?)"
                + self.hints.get("host", ""),
                scope,
                receive,
                send,
            )
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            origin = headers.get("origin")
            if origin is not None and not self.origin_allowed(origin, raw_host or "", scope):
                return await self._refuse(
                    403,
                    f"Origin {origin!r} may not change anything here (a cross-site request)"
                    + self.hints.get("origin", ""),
                    scope,
                    receive,
                    send,
                )
            if self.token is not None and scope["path"].startswith(self.token_prefix) and not self._has_token(headers):
                return await self._refuse(
                    403, "missing or stale page token: reload the page (its writes need the token it is served with)",
                    scope, receive, send,
                )  # fmt: skip
        if self.token is None or scope["type"] != "http" or scope["path"].startswith(self.token_prefix):
            return await self.app(scope, receive, send)
        return await self.app(scope, receive, self._with_cookie(scope, send))

    def origin_allowed(self, origin: str, host: str, scope) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # 'null' (a sandboxed frame, a file: page), or malformed
        try:
            o_name, o_port = split_host(parts.netloc)
            h_name, h_port = split_host(host)
        except ValueError:
            return False
        scheme = scope.get("scheme", "http")
        default = 443 if scheme == "https" else 80
        return parts.scheme == scheme and o_name == h_name and (o_port or default) == (h_port or default)

    def cookie_name(self, scope) -> str:
        server = scope.get("server")
        return f"{self.cookie}_{server[1]}" if server and server[1] else self.cookie  # cookies ignore ports

    def _has_token(self, headers: dict[str, str]) -> bool:
        assert self.token is not None
        sent = headers.get(TOKEN_HEADER.lower())
        if sent is not None:
            return hmac.compare_digest(sent.strip().encode(), self.token)
        for part in headers.get("cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key.startswith(self.cookie) and hmac.compare_digest(value.strip().encode(), self.token):
                return True
        return False

    def _with_cookie(self, scope, send):
        assert self.token is not None
        cookie = f"{self.cookie_name(scope)}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict".encode()

        async def sending(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"set-cookie", cookie)]}
            await send(msg)

        return sending

    async def _refuse(self, status: int, msg: str, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.error(status, msg, {})(scope, receive, send)


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}


# ---------------------------------------------------------------------------- auth


class BearerAuth:
    """ASGI middleware: a request under `prefix` without `Authorization: Bearer <key>` gets a
    401 (`error`, with `WWW-Authenticate: Bearer`) before its body is read; other paths pass."""

    def __init__(self, app: ASGIApp, key: str | Sequence[str], *, error: ErrorResponse, prefix: str = "/v1/") -> None:
        keys = (key,) if isinstance(key, str) else tuple(key)
        if not keys:
            raise ValueError("BearerAuth needs at least one key")
        self.app, self.keys, self.error, self.prefix = app, [k.encode() for k in keys], error, prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # every key compared, in constant time each: which one matched does not show in the timing
        matched = [hmac.compare_digest(token.strip(), k) for k in self.keys]
        if scheme.lower() == b"bearer" and any(matched):
            return await self.app(scope, receive, send)
        msg = "missing API key: send 'Authorization: Bearer <key>'" if not header else "invalid API key"
        await self.error(401, msg, {"WWW-Authenticate": "Bearer"})(scope, receive, send)


# ---------------------------------------------------------------------------- body size


class BodyTooLarge(Exception):
    """Raised into the app by BodyLimit's `receive` once the body passed its limit."""


class BodyLimit:
    """ASGI middleware: a request body over its route's limit (`routes[path]`, else `limit`)
    gets a 413 (`error`), whatever its content type. The body streams through: each
    `http.request` message is counted as the app reads it; once the count passes the limit
    the app's read raises BodyTooLarge, whatever the app answers to that is dropped, and
    the 413 is sent instead (the server then closes the connection, the rest unread)."""

    def __init__(
        self, app: ASGIApp, limit: int, *, error: ErrorResponse, routes: Mapping[str, int] | None = None
    ) -> None:
        if limit < 1 or any(v < 1 for v in (routes or {}).values()):
            raise ValueError(f"body limits must be >= 1 byte, got {limit} and {routes}")
        self.app, self.limit, self.error, self.routes = app, limit, error, dict(routes or {})

    def limit_for(self, path: str) -> int:
        return self.routes.get(path, self.limit)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await self.error(400, "malformed Content-Length", {})(scope, receive, send)
            if n > limit:
                return await self._too_large(f"{n:,} bytes", limit, scope, receive, send)
        seen, over, started = 0, False, False

        async def counted():
            nonlocal seen, over
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    over = True
                    raise BodyTooLarge(f"request body over {limit} bytes")
            return msg

        async def guarded(msg):
            nonlocal started
            if over:  # the app's answer to the refused read: the 413 goes instead
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._too_large(f"more than {limit:,} bytes", limit, scope, receive, send)

    async def _too_large(self, what: str, limit: int, scope, receive, send) -> None:
        msg = f"request body of {what} is over the limit of {limit:,} bytes"
        await self.error(413, msg, {"Connection": "close"})(scope, receive, send)


# ---------------------------------------------------------------------------- shutdown


class AbortLog:
    """ASGI middleware: a request cancelled by the server (its task cancelled: uvicorn's
    shutdown after the grace period) logs one warning - method, path, whether its response
    had started - and ends its response, instead of a CancelledError traceback."""

    def __init__(self, app: ASGIApp, *, error: ErrorResponse, name: str = "server") -> None:
        self.app, self.error, self.name = app, error, name

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False}

        async def tracked(msg):
            if msg["type"] == "http.response.start":
                state["started"] = True
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                state["ended"] = True
            await send(msg)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            where = "its response cut short" if state["started"] else "before it was answered"
            log.warning("%s: %s %s aborted by the shutdown, %s", self.name, scope["method"], scope["path"], where)
            try:
                if not state["started"]:
                    await self.error(503, f"the {self.name} is shutting down", {"Connection": "close"})(
                        scope, receive, send
                    )
                elif not state["ended"]:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # the connection is gone already: nothing left to end
                pass
