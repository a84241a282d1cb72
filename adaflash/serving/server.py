"""OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

The engine's step loop runs on its own thread; async handlers submit a `Request` whose sink
pushes (new tokens, finished) into that handler's asyncio queue through the loop's `Handoff`, so
no handler ever blocks the event loop and the step loop never waits for a client.
`create_app` is the list of routes; the work is in `translate.py` (an OpenAI body → the engine's
requests), `stream.py` (the step-loop → handler bridge, server-sent events), `replies.py` (the
response shapes) and `admin.py` (`/health`, `/metrics`, the drafter reload).

Endpoints: `/v1/completions`, `/v1/chat/completions` (SSE streaming and plain JSON), `/v1/models`,
`/health`, `/metrics` (Prometheus), `POST /admin/drafter/reload` (bearer token).
Extensions beyond the OpenAI schema: request field `method` (ar | ngram | dflash | adaflash, default the
server's), response `choices[].token_ids` and an `adaflash` object (τ, mean k̂, drafter version).
Logprobs (chat `logprobs` + `top_logprobs`, completions `logprobs: k`, up to 20) are the target's
own log-softmax at each returned token id (one entry per id, before temperature/top-k/top-p).
Tenant: header `X-Tenant-Id`, else the OpenAI `user` field. Feedback consent: header
`X-Feedback-Consent: false` opts the request out of training and out of the suffix cache (the
record still flows, flagged, so governance can count and drop it). `X-Suffix-Cache: off`: the
request does not draft from its tenant's suffix cache. `X-Prefix-Cache: off`: the request neither
reuses nor leaves its tenant's cached prompt heads (`prefix_cache.py`); a request without consent
reuses them but leaves none.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaflash.errors import InputError
from adaflash.serving.admin import Admin
from adaflash.serving.edge import EdgeLimits, uvicorn_config
from adaflash.serving.engine import Engine, EngineFailed, Request
from adaflash.serving.metrics import ServingMetrics
from adaflash.serving.protocol import ERROR_TYPES, ModelNotFound, error_response, validation_message
from adaflash.serving.reload import DrafterReloader
from adaflash.serving.replies import Replies
from adaflash.serving.scheduler import QueueFull
from adaflash.serving.stream import Bridge, finished_unless_gone, sse_events
from adaflash.serving.translate import Prepared, ServerSettings, Translator, choice_request

__all__ = ["ServerSettings", "ServerThread", "create_app", "edge_limits"]

log = logging.getLogger(__name__)


def create_app(engine: Engine, settings: ServerSettings | None = None, feedback=None) -> FastAPI:
    """`feedback`: the `FeedbackProducer` whose delivery counts /metrics exports, if any."""
    settings = settings or ServerSettings()
    metrics = ServingMetrics(engine)
    metrics.attach_suffix_cache()
    if feedback is not None:
        metrics.attach_feedback(feedback)
    reloader = DrafterReloader(engine, metrics)
    app = FastAPI(title="AdaFlash serving", version="1")
    app.state.engine, app.state.metrics, app.state.reloader = engine, metrics, reloader
    app.state.settings = settings
    gen = Generation(engine, settings, metrics)
    models = Models(settings.model_name)
    admin = Admin(engine, metrics, reloader, settings.admin_token, feedback, app.state)

    # Generation bodies are parsed by `Translator.prepare`, off the event loop, not by FastAPI.
    app.post("/v1/completions")(gen.completions)
    app.post("/v1/chat/completions")(gen.chat_completions)
    app.get("/v1/models")(models.list)
    app.get("/v1/models/{model_id:path}")(models.one)
    app.get("/health")(admin.health)
    app.get("/metrics")(admin.prometheus)
    app.post("/admin/drafter/reload")(admin.reload)
    add_error_handlers(app, metrics)
    return app


class Generation:
    """`/v1/completions` and `/v1/chat/completions`: translate the body, submit its n choices to
    the engine, and answer as server-sent events or, once all have finished, in one body."""

    def __init__(self, engine: Engine, settings: ServerSettings, metrics: ServingMetrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.translator = Translator(engine, settings)
        self.preparing = 0  # bodies being parsed and tokenised on worker threads right now

    def overloaded(self) -> JSONResponse | None:
        """A 429 before any work when the queue is full, or as many bodies as it holds are still
        being parsed and tokenised: under a flood, preparing bodies that the queue would refuse
        anyway only piles up threads and memory."""
        sched = self.engine.scheduler
        if max(len(sched.pending), self.preparing) < sched.config.max_queue:
            return None
        return self.queue_full("the server is at capacity", sched.retry_after())

    async def completions(self, http: HttpRequest):
        return await self.generate(http, chat=False)

    async def chat_completions(self, http: HttpRequest):
        return await self.generate(http, chat=True)

    async def generate(self, http: HttpRequest, chat: bool):
        # The body was read (bounded in size and time) by the edge's BodyLimit middleware.
        if (busy := self.overloaded()) is not None:
            return busy
        self.preparing += 1
        try:
            p = await asyncio.to_thread(self.translator.prepare, await http.body(), chat)
        except InputError as e:
            return self.refused(e)
        finally:
            self.preparing -= 1
        bridge = Bridge(asyncio.get_running_loop())
        reqs = self.submit(p, http, bridge)
        if isinstance(reqs, JSONResponse):
            return reqs
        tok = self.translator.tok
        replies = Replies(
            reqs, tok, self.engine.eos, self.settings.model_name, chat, p.params.logprobs is not None
        )
        if p.body.stream:
            events = sse_events(self.engine, bridge, replies, p.params.stop)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        if not await finished_unless_gone(bridge.all_finished(p.n), http):
            for r in reqs:  # the client hung up: nobody will read the rest, free the slots now
                self.engine.cancel(r.request_id)
            return Response(status_code=499)
        if any(r.cancelled for r in reqs):
            return Response(status_code=499)
        if (err := self.failed(reqs)) is not None:
            return err
        return replies.body()

    def submit(self, p: Prepared, http: HttpRequest, bridge: Bridge) -> list[Request] | JSONResponse:
        """The n choices in the engine, each sinking into `bridge`; or the error response, with
        the choices already submitted cancelled."""
        reqs: list[Request] = []
        try:
            for i in range(p.n):
                req = choice_request(p, i, http.headers)
                req.sink = bridge.sink_for(i)
                self.engine.submit(req)
                reqs.append(req)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the queued siblings must go
            for r in reqs:  # nobody will read the choices already queued: free their slots
                self.engine.cancel(r.request_id)
            return self.submit_error(e)
        return reqs

    def submit_error(self, e: Exception) -> JSONResponse:
        """The response for an error raised while queueing a request's choices."""
        if isinstance(e, EngineFailed):
            return error_response(503, str(e), "server_error")
        if isinstance(e, QueueFull):
            return self.queue_full(str(e), e.retry_after)
        if isinstance(e, InputError):
            self.metrics.rejected.labels("invalid").inc()
            return error_response(400, str(e))
        log.exception("submitting a request failed", exc_info=e)
        return error_response(500, f"internal server error: {type(e).__name__}", "server_error")

    def queue_full(self, message: str, retry_after: int) -> JSONResponse:
        self.metrics.rejected.labels("queue_full").inc()
        return error_response(429, message, "rate_limit_error", {"Retry-After": str(retry_after)})

    def refused(self, e: InputError) -> JSONResponse:
        self.metrics.rejected.labels("invalid").inc()
        if isinstance(e, ModelNotFound):
            return error_response(404, str(e), code="model_not_found")
        return error_response(400, str(e))

    def failed(self, reqs: list[Request]) -> JSONResponse | None:
        bad = [r for r in reqs if r.error is not None]
        if not bad:
            return None
        if all(r.error_kind == "invalid" for r in bad):
            self.metrics.rejected.labels("invalid").inc()
            return error_response(400, bad[0].error)
        return error_response(500, bad[0].error, "server_error")


class Models:
    """`/v1/models`: the one model this server serves."""

    def __init__(self, model_name: str) -> None:
        self.name = model_name

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "adaflash"}

    async def list(self):
        return {"object": "list", "data": [self.card()]}

    async def one(self, model_id: str):
        if model_id != self.name:
            return error_response(404, f"The model {model_id!r} does not exist", code="model_not_found")
        return self.card()


def add_error_handlers(app: FastAPI, metrics: ServingMetrics) -> None:
    """Every error a handler does not answer itself, as an OpenAI error object."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: HttpRequest, exc: RequestValidationError):
        metrics.rejected.labels("invalid").inc()
        return error_response(400, validation_message(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def httperror_response(_: HttpRequest, exc: StarletteHTTPException):
        kind = ERROR_TYPES.get(
            exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error"
        )
        return error_response(exc.status_code, str(exc.detail), kind, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internalerror_response(_: HttpRequest, exc: Exception):
        log.exception("unhandled error in a request handler")
        return error_response(500, f"internal server error: {type(exc).__name__}", "server_error")


def edge_limits(app: FastAPI) -> EdgeLimits:
    """The limits `create_app`'s settings name (the defaults for another app, e.g. the gateway)."""
    settings = getattr(app.state, "settings", None)
    return settings.edge if isinstance(settings, ServerSettings) else EdgeLimits()


class ServerThread:
    """uvicorn in a background thread (tests, benchmark); `adaflash serve` runs it in the foreground."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn_config(app, host, port, edge_limits(app)))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = f"http://{host}:{port}"

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
