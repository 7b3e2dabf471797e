"""`qcfuse serve`'s errors over real HTTP on 127.0.0.1: one shape on every route and from
every layer - {"error": {"message", "type", "param", "code"}} with a string `code` (issue 66,
item 4: some answers carried 400 or 401 as an integer) - and the three 500s of issue 62
(item 5) that are now 400s naming the field (a schema nested 400 deep, a schema that
recurses without end) or an answer (a temperature of 1e-45 is greedy). A tiny random model."""

from __future__ import annotations

import httpx
import pytest

from qcfuse_core.serve.app import ServeConfig, create_app
from tests.qc_fixtures import LiveServer, _engine, _prompt, tiny  # noqa: F401 (tiny: the fixture, shared)

KEY = "k-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tiny):
    eng = _engine(tiny)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def live(engine):
    server = LiveServer(create_app(engine, config=ServeConfig(api_key=KEY, max_body_bytes=16 << 10)))
    yield server
    server.close()


def _shape(res: httpx.Response, status: int, code: str, *words: str) -> dict:
    assert res.status_code == status, (res.status_code, res.text)
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["code"], str) and err["code"] == code, err
    for w in words:
        assert w in err["message"], err
    return err


def test_every_route_and_layer_answers_one_error_shape_with_a_string_code(live, engine, monkeypatch):
    url, ok = live.url, {"prompt": _prompt(), "max_tokens": 1}
    _shape(httpx.post(url + "/v1/completions", json=ok), 401, "invalid_api_key")  # BearerAuth
    _shape(httpx.post(url + "/v1/completions", json=ok, headers={**AUTH, "Host": "evil.example"}), 403, "forbidden")
    _shape(httpx.post(url + "/v1/completions", content=b"x" * (17 << 10), headers=AUTH), 413, "request_too_large")
    _shape(httpx.get(url + "/v1/nothing", headers=AUTH), 404, "not_found", "no such endpoint")
    _shape(httpx.post(url + "/v1/completions", json={**ok, "model": "gpt-9"}, headers=AUTH), 404, "model_not_found")
    _shape(httpx.post(url + "/v1/completions", json={**ok, "temprature": 1}, headers=AUTH), 400, "invalid_request",
           "temprature")
    _shape(httpx.post(url + "/v1/chat/completions", json={"max_tokens": 1}, headers=AUTH), 400, "invalid_request",
           "messages")  # FastAPI's validation
    _shape(httpx.post(url + "/v1/completions", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"}),
           400, "invalid_request")
    _shape(httpx.post(url + "/v1/chunks", json={"texts": "one text"}, headers=AUTH), 400, "invalid_request", "texts")
    _shape(httpx.request("OPTIONS", url + "/v1/models", headers=AUTH), 405, "method_not_allowed")

    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "stats", broken)  # /health reads it: an exception no handler expects
    err = _shape(httpx.get(url + "/health"), 500, "internal_error", "RuntimeError")
    assert err["type"] == "server_error"
    monkeypatch.undo()
    assert httpx.get(url + "/health").status_code == 200  # still serving


def _nested(levels: int) -> dict:
    root = node = {"type": "object", "properties": {}}
    for _ in range(levels - 1):
        node["properties"]["a"] = node = {"type": "object", "properties": {}}
    return root


def _forced_call(parameters: dict) -> dict:
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                             "parameters": parameters}}
    return {"messages": [{"role": "user", "content": "Look up word1x3."}], "tools": [tool], "max_tokens": 8,
            "tool_choice": {"type": "function", "function": {"name": "lookup"}}}


def test_issue_62_the_three_500s(live):
    """N-V8: a forced tool call's schema nested 400 deep; N-V9: its schema `{"$ref": "#"}`;
    N-V3: temperature 1e-45. Each was a 500."""
    url = live.url + "/v1/chat/completions"
    err = _shape(httpx.post(url, json=_forced_call(_nested(400)), headers=AUTH), 400, "invalid_request",
                 "tools[0].function.parameters: the JSON schema nests")
    assert err["param"] == "tools"
    err = _shape(httpx.post(url, json=_forced_call({"$ref": "#"}), headers=AUTH), 400, "invalid_request",
                 "tools[0].function.parameters: the JSON schema recurses without end")
    assert err["param"] == "tools"
    deep = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(400)}}}
    err = _shape(httpx.post(url, json=deep, headers=AUTH), 400, "invalid_request", "response_format: the JSON schema nests")
    assert err["param"] == "response_format"
    body = {"prompt": _prompt(), "max_tokens": 6}
    tiny_t = httpx.post(live.url + "/v1/completions", json={**body, "temperature": 1e-45}, headers=AUTH)
    assert tiny_t.status_code == 200, tiny_t.text
    greedy = httpx.post(live.url + "/v1/completions", json={**body, "temperature": 0}, headers=AUTH)
    assert tiny_t.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_the_answer_says_what_answered(live, engine):
    """The response's `qcfuse` field carries the one line of what answered (issue 66 item 2)."""
    body = {"prompt": _prompt(), "max_tokens": 2, "temperature": 0}
    got = httpx.post(live.url + "/v1/completions", json=body, headers=AUTH).json()["qcfuse"]
    assert got["answered"] == engine.complete(_prompt(), max_new_tokens=2).what_answered()
    assert got["answered"].startswith("qcfuse @ 0.15 · guard: ")
