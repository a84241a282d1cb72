"""OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

The engine's step loop runs on its own thread; async handlers submit a `Request` whose sink
pushes (new tokens, finished) into that handler's asyncio queue via `call_soon_threadsafe`, so
no handler ever blocks the event loop and the step loop never waits for a client.

Endpoints: `/v1/completions`, `/v1/chat/completions` (SSE streaming and plain JSON), `/v1/models`,
`/health`, `/metrics` (Prometheus), `POST /admin/drafter/reload` (bearer token).
Extensions beyond the OpenAI schema: request field `method` (ar | ngram | dflash | adaflash, default the
server's), response `choices[].token_ids` and an `adaflash` object (τ, mean k̂, drafter version).
Logprobs (chat `logprobs` + `top_logprobs`, completions `logprobs: k`, up to 20) are the target's
own log-softmax at each returned token id (one entry per id, before temperature/top-k/top-p).
Tenant: header `X-Tenant-Id`, else the OpenAI `user` field. Feedback consent: header
`X-Feedback-Consent: false` opts the request out of training and out of the suffix cache (the
record still flows, flagged, so governance can count and drop it). `X-Suffix-Cache: off`: the
request does not draft from its tenant's suffix cache.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaflash.errors import CheckpointError, InputError
from adaflash.serving.edge import EdgeLimits, uvicorn_config
from adaflash.serving.engine import Engine, EngineFailed, GenParams, Request
from adaflash.serving.metrics import ServingMetrics
from adaflash.serving.protocol import (
    ERROR_TYPES,
    MAX_STOP,
    UNSUPPORTED_FIELDS,
    ChatBody,
    CompletionBody,
    ModelNotFound,
    ReloadBody,
    RequestBody,
    chat_prompt_ids,
    check_text,
    error_response,
    parse_body,
    validation_message,
)
from adaflash.serving.reload import DrafterReloader
from adaflash.serving.request import MAX_LOGPROBS, SEED_MAX, SEED_MIN, TokenLogprob
from adaflash.serving.scheduler import QueueFull


@dataclass
class ServerSettings:
    model_name: str = "adaflash"
    admin_token: str | None = None  # None: the admin API answers 403
    default_max_tokens: int = 128
    max_n: int = 8  # choices per request (each takes a KV slot)
    edge: EdgeLimits = field(default_factory=EdgeLimits)  # body size, header/body/idle timeouts


log = logging.getLogger(__name__)

# How often a non-streaming handler asks whether its client is still there: tokens may arrive
# far more often than that, so the connection is polled, not the gap between tokens.
DISCONNECT_POLL_S = 0.1


class _Stream:
    """Bridge from the step-loop thread to the handler's event loop, for the n choices of one
    HTTP request: items are (choice index, new tokens, finished, their logprobs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def sink_for(self, index: int):
        def sink(req: Request, new: list[int], finished: bool) -> None:
            # Taken now, on the step-loop thread: the entries of exactly these tokens.
            lps = req.logprobs[len(req.logprobs) - len(new) :] if new and req.logprobs else []
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, list(new), finished, lps))

        return sink


class LogprobsFormat:
    """One choice's logprobs in OpenAI's shapes, built token by token (a stream sends each
    chunk's): chat `{"content": [{token, logprob, bytes, top_logprobs}]}` or the legacy
    completions `{tokens, token_logprobs, top_logprobs, text_offset}`. A token's text is its bytes
    when they are UTF-8, else OpenAI's `bytes:\\xNN` spelling (a piece of a multi-byte character;
    `bytes` has the raw values), so distinct tokens never share a key of `top_logprobs`;
    `text_offset` counts characters of the text the tokens decode to."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tok, self.chat = tokenizer, chat
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def _pieces(self, ids: list[int]) -> list[bytes]:
        try:
            return self.tok.token_bytes(ids)
        except NotImplementedError:  # not a byte-level vocabulary: each token's own decoding
            return [self.tok.decode([i]).encode() for i in ids]

    def _text(self, token: int, raw: bytes) -> str:
        if not raw:  # a special token (eos): no text of its own, so its name
            hf = getattr(self.tok, "tok", None)
            name = hf.convert_ids_to_tokens(token) if hf is not None else None
            return name if isinstance(name, str) else f"<|token_{token}|>"
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def format(self, entries: list[TokenLogprob]) -> dict | None:
        if not entries:
            return None
        ids = [e.token for e in entries]
        alt_ids = sorted({t for e in entries for t, _ in e.top} - set(ids))
        raw = dict(zip(ids + alt_ids, self._pieces(ids + alt_ids), strict=True))
        text = {t: self._text(t, b) for t, b in raw.items()}
        if self.chat:

            def entry(t: int, lp: float) -> dict:
                return {"token": text[t], "logprob": lp, "bytes": list(raw[t])}

            content = [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                       for e in entries]  # fmt: skip
            return {"content": content, "refusal": None}
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            alts = {text[t]: lp for t, lp in e.top}
            alts.setdefault(text[e.token], e.logprob)  # the chosen token is always listed, as OpenAI does
            out["tokens"].append(text[e.token])
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(self.offset)
            self.offset += len(self._utf8.decode(raw[e.token]))
        return out


def output_text(tokenizer, eos: set[int], req: Request) -> str:
    """The completion's text: eos tokens dropped, cut where a stop sequence begins."""
    text = tokenizer.decode([t for t in req.output_ids if t not in eos])
    return text[: req.stop_index] if req.stop_index is not None else text


class TextDelta:
    """Incremental detokenisation: decode everything, emit the new suffix, hold back a trailing
    replacement char (a multi-byte character split across tokens) and any tail that could be the
    start of a stop sequence (the engine may still match it: stop text is never streamed)."""

    def __init__(self, tokenizer, eos: set[int], stop: tuple[str, ...] = ()) -> None:
        self.tok, self.eos, self.stop = tokenizer, eos, stop
        self.ids: list[int] = []
        self.sent = ""

    def _held(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, new: list[int], final: bool, stop_index: int | None = None) -> str:
        self.ids.extend(t for t in new if t not in self.eos)
        text = self.tok.decode(self.ids)
        if final:
            if stop_index is not None:
                text = text[:stop_index]
        else:
            if text.endswith("\ufffd"):
                text = text[:-1]
            text = text[: len(text) - self._held(text)]
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


@dataclass
class Prepared:
    """A generation request as parsed and checked off the event loop, ready for the engine."""

    body: RequestBody
    params: GenParams
    n: int
    ids: list[int]
    text: str


async def finished_unless_gone(work, http: HttpRequest) -> bool:
    """Await `work` while polling the client's connection: True when it completed, False (and
    `work` cancelled) as soon as the client is gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return True
            if await http.is_disconnected():
                return False
    finally:
        task.cancel()


def suffix_health(engine: Engine, feed) -> dict:
    """The fast learner in `/health`: its size, tenants and the last clean offsets it applied."""
    body = engine.suffix_cache.stats().as_dict()
    body["tenant_ids"] = engine.suffix_cache.tenants()[:50]
    body["enabled"] = engine.suffix_cache.config.enabled
    if feed is not None:
        body["feed"] = {"ready": feed.ready, "applied": feed.applied, "error": feed.error}
    return body


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
    tok = engine.target.tokenizer

    def gen_params(body: RequestBody) -> tuple[GenParams, int]:
        """Validate the request's fields and build its sampling parameters — before anything is
        encoded, decoded or seeded."""
        if body.model is not None and body.model != settings.model_name:
            raise ModelNotFound(
                f"The model {body.model!r} does not exist (this server serves {settings.model_name!r})"
            )
        check_text(body.model_dump(), "the request")
        extra = body.model_extra or {}
        for name, off in UNSUPPORTED_FIELDS.items():
            if name in extra and extra[name] not in off:
                raise InputError(f"{name} is not supported by this server")
        fmt = extra.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise InputError("response_format is not supported: only plain text")
        n = 1 if body.n is None else body.n
        if not 1 <= n <= settings.max_n:
            raise InputError(f"n must be between 1 and {settings.max_n}")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = settings.default_max_tokens
        if max_tokens < 1:
            raise InputError("max_tokens must be at least 1")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP or any(not s for s in stop):
            raise InputError(f"stop must be at most {MAX_STOP} non-empty strings")
        if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX:
            raise InputError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        params = GenParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            seed=body.seed,
            method=body.method,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            stop=stop,
            logprobs=requested_logprobs(body),
        )
        probe = Request([0], dataclasses.replace(params, max_tokens=1))
        engine.validate_params(probe)
        return params, n

    def requested_logprobs(body: RequestBody) -> int | None:
        """GenParams.logprobs from chat's `logprobs` + `top_logprobs` or completions' `logprobs`."""
        if isinstance(body, ChatBody):
            top = body.top_logprobs
            if top is not None and not 0 <= top <= MAX_LOGPROBS:
                raise InputError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]")
            if not body.logprobs:
                if top:
                    raise InputError("top_logprobs needs logprobs: true")
                return None
            return top or 0
        k = getattr(body, "logprobs", None)
        if isinstance(k, bool):
            k = 0 if k else None
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise InputError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]")
        return k

    def choice_seed(seed: int | None, i: int) -> int | None:
        if seed is None:
            return None  # each choice draws its own random seed
        span = SEED_MAX - SEED_MIN + 1
        return (seed + i - SEED_MIN) % span + SEED_MIN

    def make_request(
        params: GenParams, body: RequestBody, prompt_ids, prompt_text: str, http: HttpRequest
    ) -> Request:
        tenant = http.headers.get("x-tenant-id") or body.user or "anonymous"
        consent = http.headers.get("x-feedback-consent", "true").strip().lower() not in ("0", "false", "no")
        # `X-Suffix-Cache: off`: this request does not draft from its tenant's cache (an A/B of the
        # fast learner on live traffic; its own prompt and output still can).
        cache = http.headers.get("x-suffix-cache", "on").strip().lower() not in ("0", "false", "no", "off")
        return Request(
            prompt_ids,
            params,
            request_id=uuid.uuid4().hex,
            prompt_text=prompt_text,
            tenant_id=tenant,
            consent=consent,
            domain=body.domain or http.headers.get("x-domain"),
            use_suffix_cache=cache,
        )

    def usage(reqs: list[Request]) -> dict:
        n = sum(len(r.output_ids) for r in reqs)
        p = len(reqs[0].prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def extras(req: Request) -> dict:
        rounds = req.rounds
        return {
            "method": req.method,
            "drafter_version": req.drafter_version,
            "rounds": len(rounds),
            "tau": sum(r.accepted + 1 for r in rounds) / len(rounds) if rounds else None,
            "mean_verify_len": sum(r.verify_len for r in rounds) / len(rounds) if rounds else None,
        }

    def finish(req: Request) -> str:
        return req.finish_reason if req.finish_reason in ("stop", "error") else "length"

    def failed(reqs: list[Request]) -> JSONResponse | None:
        bad = [r for r in reqs if r.error is not None]
        if not bad:
            return None
        if all(r.error_kind == "invalid" for r in bad):
            metrics.rejected.labels("invalid").inc()
            return error_response(400, bad[0].error)
        return error_response(500, bad[0].error, "server_error")

    async def serve(
        body: RequestBody, params: GenParams, n: int, http: HttpRequest, prompt_ids, prompt_text, chat
    ):
        stream = _Stream(asyncio.get_running_loop())
        reqs: list[Request] = []
        try:
            for i in range(n):
                p = dataclasses.replace(params, seed=choice_seed(params.seed, i))
                req = make_request(p, body, prompt_ids, prompt_text, http)
                req.sink = stream.sink_for(i)
                engine.submit(req)
                reqs.append(req)
        except EngineFailed as e:
            return error_response(503, str(e), "server_error")
        except QueueFull as e:
            for r in reqs:
                engine.cancel(r.request_id)
            metrics.rejected.labels("queue_full").inc()
            return error_response(429, str(e), "rate_limit_error", {"Retry-After": str(e.retry_after)})
        except InputError as e:
            for r in reqs:
                engine.cancel(r.request_id)
            metrics.rejected.labels("invalid").inc()
            return error_response(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + reqs[0].request_id
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        wants_logprobs = params.logprobs is not None
        formats = [LogprobsFormat(tok, chat) for _ in reqs]

        def logprobs_of(i: int, entries: list[TokenLogprob]) -> dict | None:
            return formats[i].format(entries) if wants_logprobs else None

        def chunk_of(i: int, text: str, new: list[int], first: bool, done: bool, lps: list) -> dict:
            r = reqs[i]
            if chat:
                d: dict = {"content": text}
                if first:
                    d["role"] = "assistant"
                choice = {"index": i, "delta": d, "logprobs": logprobs_of(i, lps)}
                choice["finish_reason"] = finish(r) if done else None
            else:
                choice = {
                    "index": i,
                    "text": text,
                    "logprobs": logprobs_of(i, lps),
                    "finish_reason": finish(r) if done else None,
                }
            choice["token_ids"] = new
            chunk = {
                "id": rid,
                "object": obj + (".chunk" if chat else ""),
                "created": created,
                "model": settings.model_name,
                "choices": [choice],
            }
            if done and r.error is not None:  # already streaming: the error rides on the chunk
                chunk["error"] = {
                    "message": r.error,
                    "type": "invalid_request_error" if r.error_kind == "invalid" else "server_error",
                }
            return chunk

        if body.stream:

            async def events() -> AsyncIterator[str]:
                deltas = [TextDelta(tok, engine.eos, params.stop) for _ in reqs]
                done = [False] * n
                first = [True] * n
                try:
                    while not all(done):
                        i, new, fin, lps = await stream.queue.get()
                        if done[i]:
                            continue
                        r = reqs[i]
                        if r.cancelled:
                            return
                        text = deltas[i].push(new, fin, r.stop_index)
                        chunk = chunk_of(i, text, new, first[i], fin, lps)
                        first[i], done[i] = False, fin
                        if all(done):
                            chunk["usage"] = usage(reqs)
                            chunk["adaflash"] = extras(reqs[0])
                        yield "data: " + json.dumps(chunk) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    for r, d in zip(reqs, done, strict=True):
                        if not d:  # the client went away: free the slot now
                            engine.cancel(r.request_id)

            return StreamingResponse(
                events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        async def all_finished() -> None:
            finished: set[int] = set()
            while len(finished) < n:
                i, _, fin, _ = await stream.queue.get()
                if fin:
                    finished.add(i)

        if not await finished_unless_gone(all_finished(), http):
            for r in reqs:  # the client hung up: nobody will read the rest, free the slots now
                engine.cancel(r.request_id)
            return Response(status_code=499)
        if any(r.cancelled for r in reqs):
            return Response(status_code=499)
        if (err := failed(reqs)) is not None:
            return err
        choices = []
        for i, r in enumerate(reqs):
            text = output_text(tok, engine.eos, r)
            lps = logprobs_of(i, r.logprobs)
            if chat:
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lps,
                    "finish_reason": finish(r),
                }
            else:
                choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": finish(r)}
            choice["token_ids"] = r.output_ids
            choices.append(choice)
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": settings.model_name,
            "choices": choices,
            "usage": usage(reqs),
            "adaflash": extras(reqs[0]),
        }

    def refused(e: InputError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        if isinstance(e, ModelNotFound):
            return error_response(404, str(e), code="model_not_found")
        return error_response(400, str(e))

    def completion_prompt(p) -> tuple[list[int], str]:
        if isinstance(p, list) and not p:
            raise InputError("empty prompt")
        if isinstance(p, list) and all(isinstance(x, int) for x in p):
            vocab = engine.target.config.vocab_size
            if any(x < 0 or x >= vocab for x in p):  # validated before anything decodes them
                raise InputError(f"prompt token ids must be in [0, {vocab})")
            return list(p), tok.decode(list(p))
        if isinstance(p, list):
            if len(p) != 1:
                raise InputError("batched prompts are not supported: send one prompt per request")
            p = p[0]
        ids = tok.encode(p)
        return ids, tok.decode(ids)

    def chat_prompt(body: ChatBody) -> tuple[list[int], str]:
        ids = chat_prompt_ids(tok, body.messages)
        # The feedback record's prompt_text must be decode(prompt ids) (schema invariant): the
        # templated conversation as the target saw it, not a re-rendering of the messages.
        return ids, tok.decode(ids)

    def prepare(raw: bytes, chat: bool) -> Prepared:
        """Bytes to a request the engine can take: JSON, the schema, the fields' checks, the
        prompt's token ids. CPU-bound (a body may hold millions of token ids or characters), so
        it runs on a worker thread: the event loop, and /health with it, never waits for it."""
        body = parse_body(raw, ChatBody if chat else CompletionBody)
        params, n = gen_params(body)
        ids, text = chat_prompt(body) if chat else completion_prompt(body.prompt)
        return Prepared(body, params, n, ids, text)

    async def generate(http: HttpRequest, chat: bool):
        # The body was read (bounded in size and time) by the edge's BodyLimit middleware.
        try:
            p = await asyncio.to_thread(prepare, await http.body(), chat)
        except InputError as e:
            return refused(e)
        return await serve(p.body, p.params, p.n, http, p.ids, p.text, chat=chat)

    # The body is parsed by `prepare`, off the event loop, not by FastAPI.
    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await generate(http, chat=True)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "adaflash"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != settings.model_name:
            return error_response(404, f"The model {model_id!r} does not exist", code="model_not_found")
        return model_card()

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
        body["suffix_cache"] = suffix_health(engine, getattr(app.state, "suffix_feed", None))
        if feedback is not None:
            body["feedback"] = fb = feedback.health()
            if ok and fb["degraded"]:  # still 200: serving works, and a restart would lose held records
                body["status"] = "degraded"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/drafter/reload")
    async def reload(body: ReloadBody, http: HttpRequest):
        if not settings.admin_token:
            return error_response(
                403, "the admin API is disabled: set ADAFLASH_ADMIN_TOKEN", "permission_error"
            )
        auth = http.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), settings.admin_token.encode()):
            return error_response(401, "missing or wrong bearer token", "authentication_error")
        previous = engine.drafter_version
        try:
            version = await asyncio.wrap_future(reloader.reload(body.path, body.version))
        except CheckpointError as e:
            return error_response(422, f"reload rejected, still serving {previous}: {e}", "checkpoint_error")
        except OSError as e:  # a path the filesystem refuses (too long, a loop, no permission)
            why = f"cannot read the checkpoint: {e.strerror or type(e).__name__}"
            return error_response(
                422, f"reload rejected, still serving {previous}: {why}", "checkpoint_error"
            )
        return {"status": "staged", "version": version, "previous": previous}

    return app


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
