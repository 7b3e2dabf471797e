"""The studio's FastAPI app: a JSON API under /api and the built page at /.

    GET  /api/status                      model (with its prompt frame), the model switch in
                                          progress, store, chunk count, methods, limits
    GET  /api/store                       the store's tiers: entries, bytes used / capacity,
                                          hits, misses, hit rate, evictions (tier_report.py)
    GET  /api/models                      installed models (packaged ones: converted yet or not)
    POST /api/models/select {id}          202 + a job that loads the model (stages: converting,
                                          only the first time for a packaged model; loading;
                                          warming up), followed like an ingestion job
    POST /api/search {question, top_k}    top-k chunks from Chroma, with scores and anchors
    POST /api/chunks {ids}                the chunk cards of these ids as they are now
    POST /api/run {question, chunk_ids, modes: [{method, ratio}], max_new_tokens, reference,
                   repeats}               the caches built first (timed), then one result per
                                          mode: median TTFT of `repeats`, decode rate, end to
                                          end, stages, recompute counts, cache hits / misses,
                                          memory of the run, quality against full prefill
    POST /api/run/stream                  the same as server-sent events: build, reference,
                                          mode, delta, repeat, result, done (the run), error;
                                          a client that goes away cancels the run at once
    GET  /api/history, DELETE /api/history  the run history (one row per mode of a run)
    GET  /api/runs/{run}/details/{index}  the per-token view of one mode
    POST /api/ingest (multipart `files`)  202 + a job; GET /api/jobs/{id} and
                                          /api/jobs/{id}/events (SSE) report its progress

Errors are JSON `{"error": {"message", "type"}}` with a 4xx status; a failing request never
stops the server. A body over its route's limit - `StudioConfig.max_json_bytes`, or for
/api/ingest `max_files` x `max_upload_bytes` plus the multipart framing - is refused with a
413 while it streams in, whatever its content type (qcfuse_core/asgi.py's BodyLimit). Only
the studio's own page may change anything: a foreign Host (DNS rebinding) or Origin is a
403, and every POST or DELETE under /api needs the per-process token the page is served
with (a SameSite=Strict cookie; asgi.py's LocalOnly). Model work runs on one worker thread,
one request at a time (TTFTs are not measured while another run shares the cores); the
event loop only waits on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, File, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field, field_validator

from qcfuse_core.asgi import BodyLimit, LocalOnly
from qcfuse_core.studio.service import Mode, RunCancelled, RunSpec, StudioError, StudioService, TooLarge

log = logging.getLogger(__name__)

UPLOAD_OVERHEAD = 64 * 1024  # multipart framing allowed on top of the files' bytes


def static_dir() -> Path:
    return Path(str(resources.files("qcfuse_core.studio") / "static"))


# ---------------------------------------------------------------------------- request bodies


def _not_empty(question: str) -> str:
    if not question.strip():
        raise ValueError("question is empty")
    return question


class ModeIn(BaseModel):
    method: str
    ratio: float = Field(0.15, ge=0.0, le=1.0)

    @field_validator("method")
    @classmethod
    def _known(cls, v: str) -> str:
        from qcfuse_core.selection.base import SELECTORS

        if v not in SELECTORS:
            raise ValueError(f"unknown method {v!r}; valid: {', '.join(sorted(SELECTORS))}")
        return v


class RunIn(BaseModel):
    question: str = Field(max_length=2000)
    chunk_ids: list[str] = Field(min_length=1, max_length=16)
    modes: list[ModeIn] = Field(min_length=1, max_length=8)
    max_new_tokens: int = Field(48, ge=1, le=256)
    reference: bool = True
    repeats: int = Field(1, ge=1, le=100)  # the service's max_repeats is the real limit

    _question = field_validator("question")(lambda v: _not_empty(v))

    def spec(self) -> RunSpec:
        return RunSpec(
            self.question,
            tuple(self.chunk_ids),
            tuple(Mode(m.method, m.ratio) for m in self.modes),
            self.max_new_tokens,
            self.reference,
            self.repeats,
        )


class ChunksIn(BaseModel):
    ids: list[str] = Field(min_length=1, max_length=50)


class SearchIn(BaseModel):
    question: str = Field(max_length=2000)
    top_k: int = Field(4, ge=1, le=50)

    _question = field_validator("question")(lambda v: _not_empty(v))


class SelectModelIn(BaseModel):
    id: str = Field(min_length=1)


# ---------------------------------------------------------------------------- the app


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _refusal(status: int, message: str, headers: dict[str, str]) -> JSONResponse:
    """What the shared middlewares (qcfuse_core/asgi.py) answer - a body over the limit (413),
    a foreign Host or Origin or a missing page token (403) - in the studio's error shape."""
    return _error(status, message, "too_large" if status == 413 else "forbidden")


def create_app(service: StudioService, *, static: Path | None = None) -> FastAPI:
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qcfuse-studio")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.shutdown(wait=True, cancel_futures=True)

    app = FastAPI(
        title="QCFuse Studio", lifespan=lifespan, docs_url="/api/docs", redoc_url=None, openapi_url="/api/openapi.json"
    )
    app.state.service = service
    cfg = service.config
    upload_limit = cfg.max_files * cfg.max_upload_bytes + UPLOAD_OVERHEAD
    app.add_middleware(BodyLimit, limit=cfg.max_json_bytes, error=_refusal, routes={"/api/ingest": upload_limit})
    app.state.token = secrets.token_urlsafe(32)  # this process's; the page gets it as a cookie
    app.add_middleware(LocalOnly, error=_refusal, token=app.state.token, token_prefix="/api/", cookie="qcfuse_studio")

    async def on_worker(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    @app.exception_handler(StudioError)
    async def _studio_error(request: Request, exc: StudioError):
        return _error(exc.status, str(exc), exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        return _error(422, "; ".join(parts) or "invalid request", "invalid_request")

    # -- reading --------------------------------------------------------------------------
    @app.get("/api/status")
    async def status():
        return service.status()

    @app.get("/api/store")
    def store():  # a thread of the pool: the store's stats read its manifest
        return service.store_tiers()

    @app.get("/api/fidelity")
    def fidelity():  # a thread of the pool: the audit's intervals are computed once per check
        return service.fidelity()

    @app.get("/api/models")
    async def models():
        return service.models()

    @app.post("/api/models/select", status_code=202)
    async def select_model(body: SelectModelIn):
        job = service.start_model_job(body.id)  # an unknown id: 404 now
        if job.state != "done":
            asyncio.get_running_loop().run_in_executor(worker, service.run_model_job, job, body.id)
        return job.to_dict()

    @app.post("/api/search")
    async def search(body: SearchIn):
        return {"question": body.question, "chunks": await on_worker(service.search, body.question, body.top_k)}

    @app.post("/api/chunks")
    async def chunks(body: ChunksIn):
        return {"chunks": await on_worker(service.chunks, body.ids)}

    # -- runs -----------------------------------------------------------------------------
    @app.post("/api/run")
    async def run(body: RunIn):
        spec = body.spec()
        service.check_run(spec)
        return await on_worker(service.run, spec)

    @app.post("/api/run/stream")
    async def run_stream(body: RunIn):
        spec = body.spec()
        service.check_run(spec)  # bad input: a 4xx before the stream starts
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()  # set when the client goes away: the run stops at its next token

        def emit(event: str | None, data: dict | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (event, data))

        def work() -> None:
            try:
                emit("done", service.run(spec, emit, cancel))
            except RunCancelled:
                log.info("run cancelled: its client went away")
            except StudioError as e:
                emit("error", {"message": str(e), "type": e.kind})
            except Exception as e:  # reported to the page; the server keeps running
                log.exception("run failed")
                emit("error", {"message": f"{type(e).__name__}: {e}", "type": "server_error"})
            finally:
                emit(None, None)

        loop.run_in_executor(worker, work)

        async def events():
            try:
                while True:
                    event, data = await queue.get()
                    if event is None:
                        return
                    yield _sse(event, data)
            finally:  # finished, or the client disconnected (the generator is closed / cancelled)
                cancel.set()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    @app.get("/api/history")
    async def history():
        return service.history()

    @app.delete("/api/history")
    async def clear_history():
        return service.clear_history()

    @app.get("/api/runs/{run_id}/details/{index}")
    async def details(run_id: str, index: int):
        return await on_worker(service.details, run_id, index)

    # -- ingestion ------------------------------------------------------------------------
    @app.post("/api/ingest", status_code=202)
    async def ingest(request: Request, files: list[UploadFile] = File(...)):
        cfg = service.config
        declared = int(request.headers.get("content-length") or 0)
        if declared > cfg.max_files * cfg.max_upload_bytes + UPLOAD_OVERHEAD:
            raise TooLarge(
                f"upload of {declared:,} bytes is over the limit "
                f"({cfg.max_files} files of {cfg.max_upload_bytes:,} bytes)"
            )
        raw = []
        for f in files:
            data = await f.read(cfg.max_upload_bytes + 1)  # one byte over the limit is enough to refuse
            raw.append((f.filename or "", data))
        texts = service.prepare_files(raw)
        job = service.new_job("ingest")
        job.update(total=0, result={"files": [n for n, _ in texts]})
        loop = asyncio.get_running_loop()
        loop.run_in_executor(worker, service.run_ingest_job, job, texts)
        return job.to_dict()

    @app.get("/api/jobs/{job_id}")
    async def job(job_id: str):
        return service.job(job_id).to_dict()

    @app.get("/api/jobs/{job_id}/events")
    async def job_events(job_id: str):
        job = service.job(job_id)

        async def events():
            seen = -1
            while True:
                state = job.to_dict()
                if state["version"] != seen:
                    seen = state["version"]
                    yield _sse("progress", state)
                if state["state"] in ("done", "failed"):
                    yield _sse(state["state"], state)
                    return
                await asyncio.sleep(JOB_POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.api_route("/api/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown_api(path: str):
        return _error(404, f"no such endpoint: /api/{path}", "not_found")

    # -- the page -------------------------------------------------------------------------
    folder = static if static is not None else static_dir()
    if (folder / "index.html").is_file():
        app.mount("/", StaticFiles(directory=folder, html=True), name="page")
    else:

        @app.get("/", response_class=HTMLResponse)
        async def not_built():
            return (
                "<h1>QCFuse Studio</h1><p>The page is not built. Build it with "
                "<code>cd qcfuse_core/studio/web &amp;&amp; npm ci &amp;&amp; npm run build</code>; "
                "the API is under <a href='/api/docs'>/api</a>.</p>"
            )

    return app


JOB_POLL_S = 0.1
