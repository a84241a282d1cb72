"""OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

The engine's step loop runs on its own thread; async handlers submit a `Request` whose sink
pushes (new tokens, finished) into that handler's asyncio queue via `call_soon_threadsafe`, so
no handler ever blocks the event loop and the step loop never waits for a client.

Endpoints: `/v1/completions`, `/v1/chat/completions` (SSE streaming and plain JSON), `/v1/models`,
`/health`, `/metrics` (Prometheus), `POST /admin/drafter/reload` (bearer token).
Extensions beyond the OpenAI schema: request field `method` (ar | dflash | adaflash, default the
server's), response `choices[].token_ids` and an `adaflash` object (τ, mean k̂, drafter version).
Tenant: header `X-Tenant-Id`, else the OpenAI `user` field. Feedback consent: header
`X-Feedback-Consent: false` opts the request out of training (the record still flows, flagged,
so governance can count and drop it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from adaflash.errors import CheckpointError, InputError
from adaflash.serving.engine import Engine, GenParams, Request
from adaflash.serving.metrics import ServingMetrics
from adaflash.serving.reload import DrafterReloader
from adaflash.serving.scheduler import QueueFull


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    seed: int | None = None
    user: str | None = None
    stop: str | list[str] | None = None
    method: str | None = None
    domain: str | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


class ReloadBody(BaseModel):
    path: str
    version: str | None = None


@dataclass
class ServerSettings:
    model_name: str = "adaflash"
    admin_token: str | None = None  # None: the admin API answers 403
    default_max_tokens: int = 128


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Token ids of a conversation through the target's chat template (ours for `tiny`)."""
    msgs = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        msgs.append({"role": m.role, "content": content or ""})
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and getattr(hf, "chat_template", None):
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text)
    if len(msgs) == 1 and msgs[0]["role"] == "user":
        return tokenizer.chat_prompt(msgs[0]["content"])
    bos = [tokenizer.BOS] if hasattr(tokenizer, "BOS") else []
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
    return bos + tokenizer.encode(text)


class _Stream:
    """Per-request bridge from the step-loop thread to the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def sink(self, req: Request, new: list[int], finished: bool) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (new, finished))


class TextDelta:
    """Incremental detokenisation: decode everything, emit the new suffix, hold back a trailing
    replacement char (a multi-byte character split across tokens)."""

    def __init__(self, tokenizer, eos: set[int]) -> None:
        self.tok, self.eos = tokenizer, eos
        self.ids: list[int] = []
        self.sent = ""

    def push(self, new: list[int], final: bool) -> str:
        self.ids.extend(t for t in new if t not in self.eos)
        text = self.tok.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            text = text[:-1]
        delta, self.sent = text[len(self.sent) :], text
        return delta


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    metrics = ServingMetrics(engine)
    reloader = DrafterReloader(engine, metrics)
    app = FastAPI(title="AdaFlash serving", version="1")
    app.state.engine, app.state.metrics, app.state.reloader = engine, metrics, reloader
    tok = engine.target.tokenizer

    def make_request(body: _Body, prompt_ids: list[int], prompt_text: str, http: HttpRequest) -> Request:
        if body.n not in (None, 1):
            raise InputError("only n=1 is supported")
        if body.top_p not in (None, 1.0):
            raise InputError(
                "only top_p=1 is supported (speculative sampling verifies the full distribution)"
            )
        if body.stop:
            raise InputError(
                "stop sequences are not supported; the model's end-of-turn token ends a completion"
            )
        tenant = http.headers.get("x-tenant-id") or body.user or "anonymous"
        consent = http.headers.get("x-feedback-consent", "true").strip().lower() not in ("0", "false", "no")
        params = GenParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or settings.default_max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            seed=body.seed,
            method=body.method,
        )
        return Request(
            prompt_ids,
            params,
            request_id=uuid.uuid4().hex,
            prompt_text=prompt_text,
            tenant_id=tenant,
            consent=consent,
            domain=body.domain or http.headers.get("x-domain"),
        )

    def usage(req: Request) -> dict:
        n = len(req.output_ids)
        return {
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": n,
            "total_tokens": len(req.prompt_ids) + n,
        }

    def extras(req: Request) -> dict:
        rounds = req.rounds
        return {
            "method": req.method,
            "drafter_version": req.drafter_version,
            "rounds": len(rounds),
            "tau": sum(r.accepted + 1 for r in rounds) / len(rounds) if rounds else None,
            "mean_verify_len": sum(r.verify_len for r in rounds) / len(rounds) if rounds else None,
        }

    async def serve(body: _Body, http: HttpRequest, prompt_ids: list[int], prompt_text: str, chat: bool):
        try:
            req = make_request(body, prompt_ids, prompt_text, http)
            stream = _Stream(asyncio.get_running_loop())
            req.sink = stream.sink
            engine.submit(req)
        except QueueFull as e:
            metrics.rejected.labels("queue_full").inc()
            return _error(429, str(e), "rate_limit_error", {"Retry-After": str(e.retry_after)})
        except InputError as e:
            metrics.rejected.labels("invalid").inc()
            return _error(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        finish = lambda: "stop" if req.finish_reason == "stop" else "length"  # noqa: E731

        if body.stream:

            async def events() -> AsyncIterator[str]:
                delta = TextDelta(tok, engine.eos)
                done = False
                first = True
                try:
                    while not done:
                        new, done = await stream.queue.get()
                        if req.cancelled:
                            return
                        text = delta.push(new, done)
                        if chat:
                            d: dict = {"content": text}
                            if first:
                                d["role"] = "assistant"
                            choice = {"index": 0, "delta": d, "finish_reason": finish() if done else None}
                        else:
                            choice = {
                                "index": 0,
                                "text": text,
                                "logprobs": None,
                                "finish_reason": finish() if done else None,
                            }
                        choice["token_ids"] = new
                        chunk = {
                            "id": rid,
                            "object": obj + (".chunk" if chat else ""),
                            "created": created,
                            "model": settings.model_name,
                            "choices": [choice],
                        }
                        if done:
                            chunk["usage"] = usage(req)
                            chunk["adaflash"] = extras(req)
                        first = False
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if not done:  # the client went away: free the slot now
                        engine.cancel(req.request_id)

            return StreamingResponse(
                events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        done = False
        while not done:
            try:
                _, done = await asyncio.wait_for(stream.queue.get(), timeout=0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    engine.cancel(req.request_id)
                    return Response(status_code=499)
        if req.cancelled:
            return Response(status_code=499)
        text = tok.decode([t for t in req.output_ids if t not in engine.eos])
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish(),
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish()}
        choice["token_ids"] = req.output_ids
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": settings.model_name,
            "choices": [choice],
            "usage": usage(req),
            "adaflash": extras(req),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        p = body.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            ids, text = list(p), tok.decode(list(p))
        elif isinstance(p, list):
            if len(p) != 1:
                return _error(400, "batched prompts are not supported: send one prompt per request")
            ids = tok.encode(p[0])
            text = tok.decode(ids)
        else:
            ids = tok.encode(p)
            text = tok.decode(ids)
        return await serve(body, http, ids, text, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HttpRequest):
        ids = chat_prompt_ids(tok, body.messages)
        # The feedback record's prompt_text must be decode(prompt ids) (schema invariant): the
        # templated conversation as the target saw it, not a re-rendering of the messages.
        text = tok.decode(ids)
        return await serve(body, http, ids, text, chat=True)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "owned_by": "adaflash"}],
        }

    @app.get("/health")
    async def health():
        s = engine.scheduler
        alive = engine._thread is None or engine._thread.is_alive()
        ok = engine.failure is None and alive
        body = {
            "status": "ok" if ok else "error",
            "error": repr(engine.failure) if engine.failure else None,
            "running": len(s.running),
            "queue_depth": s.queue_depth,
            "drafter_version": engine.drafter_version,
            "method": engine.config.method,
            "reloads": engine.reloads,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/drafter/reload")
    async def reload(body: ReloadBody, http: HttpRequest):
        if not settings.admin_token:
            return _error(403, "the admin API is disabled: set ADAFLASH_ADMIN_TOKEN", "permission_error")
        auth = http.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), settings.admin_token.encode()):
            return _error(401, "missing or wrong bearer token", "authentication_error")
        previous = engine.drafter_version
        try:
            version = await asyncio.wrap_future(reloader.reload(body.path, body.version))
        except CheckpointError as e:
            return _error(422, f"reload rejected, still serving {previous}: {e}", "checkpoint_error")
        return {"status": "staged", "version": version, "previous": previous}

    return app


class ServerThread:
    """uvicorn in a background thread (tests, benchmark); `adaflash serve` runs it in the foreground."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
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
