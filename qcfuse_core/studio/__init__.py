"""QCFuse Studio: a local web page that shows what fusion did to one question.

    qcfuse studio [--store DIR] [--model NAME|DIR ...] [--port 8501]

    service.py   StudioService: search (Chroma), runs through the engine's own request
                 (engine.stream, one result per mode), ingestion jobs, model switching
    details.py   per-token view of one answer: text pieces, recompute depth, scores,
                 anchors, chunk boundaries, stage waterfall and memory
    models.py    the installed models the page can switch between (both packaged models by
                 name: smollm2-135m, gemma3-270m; --model folders; cache-dir folders)
    app.py       the FastAPI app: JSON API under /api, answers as server-sent events, the
                 built page (static/, built from web/ with Vite) at /
    cli.py       the `qcfuse studio` subcommand (binds to 127.0.0.1)

FastAPI, uvicorn and python-multipart are the optional extra `studio`; the core never
imports this package.
"""

from __future__ import annotations

STUDIO_PIP = "pip install 'qcfuse[studio]'  (fastapi, uvicorn, python-multipart)"


def require_extra() -> None:
    """Raise ImportError naming the install command when the `studio` extra is missing."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "multipart") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"qcfuse studio needs {', '.join(missing)}: {STUDIO_PIP}")
