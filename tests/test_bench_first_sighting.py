"""`qcfuse bench first-sighting` (qcfuse_core/eval/first_sighting.py, issue 66 item 1): the
shape of its rows and summary against a live server on 127.0.0.1 (uvicorn in a thread, the
tiny random fp32 model with a byte tokenizer), learning on and off. Timings are not checked."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from qcfuse_core.cli.commands import build_parser
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.eval.first_sighting import run
from qcfuse_core.learn import LearnConfig
from qcfuse_core.serve.app import ServeConfig, create_app
from qcfuse_core.store import MemoryStore
from tests.qc_fixtures import LiveServer, ledger, tiny  # noqa: F401  (fixture)


def para(i: int) -> str:
    return ledger(i)


@contextmanager
def serving(tiny, learning: LearnConfig):
    """A live server over a fresh engine (nothing registered)."""
    engine = QCFuseEngine(tiny, store=MemoryStore())
    server = LiveServer(create_app(engine, model_name="tiny-bench", config=ServeConfig(learning=learning)))
    try:
        yield server
    finally:
        server.close()
        engine.close()


@pytest.fixture()
def dataset(tmp_path):
    """Three records of four paragraphs each, in CacheBlend's format."""
    records = [
        {
            "question": f"Which ledger is {r}?",
            "answers": ["x"],
            "ctxs": [{"title": "t", "text": para(10 * r + i)} for i in range(4)],
        }
        for r in range(3)
    ]
    path = tmp_path / "sets.json"
    path.write_text(json.dumps(records))
    return path


def _args(url: str, dataset, *extra: str):
    return build_parser().parse_args(
        ["bench", "first-sighting", "--url", url, "--dataset", str(dataset), "--sets", "2", "--docs", "3",
         "--max-tokens", "2", *extra]
    )  # fmt: skip


def test_first_sighting_rows_and_summary(tiny, dataset):
    with serving(tiny, LearnConfig()) as live:
        out = run(_args(live.url, dataset, "--pairs", "--offset", "1"))
    rows, summary = out["rows"], out["summary"]
    assert [(r["set"], r["sighting"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for r in rows:
        assert r["client_ttft_ms"] > 0 and r["server_ttft_ms"] > 0 and r["prompt_tokens"] > 0
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]
    assert all(r["cached_tokens"] == 0 for r in rows if r["sighting"] == 1)  # fresh sets: nothing to reuse
    assert summary["learning"] and summary["learned"]["misses"] >= 2 * 3
    assert set(summary["learned"]) == {"builds", "hits", "misses", "dropped", "pending"}
    for key in ("sighting_1", "sighting_2"):
        assert summary[key]["requests"] == 2
        assert set(summary[key]) == {"requests", "client_ttft_ms", "server_ttft_ms", "cached_share"}


def test_first_sighting_against_a_server_that_learns_nothing(tiny, dataset):
    with serving(tiny, LearnConfig(enabled=False)) as live:
        out = run(_args(live.url, dataset))
    assert [r["sighting"] for r in out["rows"]] == [1, 1]
    assert out["summary"]["learning"] is False and out["summary"]["learned"] is None
    assert "sighting_2" not in out["summary"]


def test_first_sighting_refuses_sets_without_enough_passages(tiny, dataset):
    with pytest.raises(ValueError, match="hold 5 passages"):
        run(_args("http://127.0.0.1:9", dataset, "--docs", "5"))
