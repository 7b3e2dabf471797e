"""`qcfuse serve`: an OpenAI-compatible HTTP server over the engine's scheduler.

    qcfuse serve --store DIR [--model NAME|DIR] [--host 127.0.0.1] [--port 8000]

    protocol.py  the request bodies (OpenAI's chat and completion fields, plus `qcfuse`:
                 documents | node_ids, method, ratio), checked; the response and chunk
                 shapes; OpenAI's error body
    metrics.py   the Prometheus metrics of one app (its own registry): latency histograms,
                 requests by outcome, tokens, cache hits, recompute share; scheduler gauges
                 read at scrape time
    app.py       create_app(engine, model_name=...): the FastAPI app (routes, SSE streaming,
                 errors, client disconnects abort their request)
    cli.py       the `qcfuse serve` subcommand (binds to 127.0.0.1 unless told otherwise)
    replicas.py  `qcfuse serve --replicas N`: engine replicas on Ray Serve over one store
                 folder, an ingress, and the chunk-affinity request router (extra `ray`)

FastAPI, uvicorn and prometheus-client are the optional extra `serve`; the core never
imports this package.
"""

from __future__ import annotations

SERVE_PIP = "pip install 'qcfuse[serve]'  (fastapi, uvicorn, prometheus-client)"


def require_extra() -> None:
    """Raise ImportError naming the install command when the `serve` extra is missing."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"qcfuse serve needs {', '.join(missing)}: {SERVE_PIP}")
