"""Feedback gateway: an OpenAI-compatible reverse proxy that turns any backend's traffic into feedback.

Requests are forwarded unchanged to the upstream (SGLang, vLLM or our engine) and its response is
returned byte for byte — streamed chunks as they arrive. When a request finishes, the gateway
builds one `FeedbackRecord` from (prompt, output) with the target's tokenizer and hands it to the
spooling producer off the request path. The trainer recomputes everything else from the text, so
records from a fleet that reports no speculative rounds are as trainable as our engine's (with
random anchors). The tenant comes from the API key; a request without a known key is refused.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from adaflash.feedback.schema import FeedbackRecord, Latency, SamplingParams
from adaflash.models.targets import Vocabulary
from adaflash.serving.protocol import LABEL_MAX, ChatMessage, chat_prompt_ids, error_response

log = logging.getLogger(__name__)


@dataclass
class GatewaySettings:
    upstream: str  # base URL of an OpenAI-compatible server, e.g. http://sglang:30000
    api_keys: dict[str, str]  # API key -> tenant id
    drafter_version: str | None = None  # what the fleet serves, when the upstream does not say
    method: str = "dflash"  # what the fleet runs (SGLang DFLASH = fixed k)
    block_size: int = 16
    timeout_s: float = 600.0
    extra: dict = field(default_factory=dict)


def _domain(body: dict) -> str | None:
    """The record's domain label from `metadata.domain`, when it is a short printable string (the
    upstream decides on the request; the record only drops a label it cannot key by)."""
    meta = body.get("metadata")
    d = meta.get("domain") if isinstance(meta, dict) else None
    return d if isinstance(d, str) and len(d) <= LABEL_MAX and d.isprintable() else None


def _unauthorized(msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "authentication_error"}}, status_code=401)


@dataclass
class Exchange:
    """One proxied request as the gateway saw it, for its feedback record."""

    body: dict
    chat: bool
    tenant: str
    consent: bool
    t0: float  # perf_counter when it was forwarded


def feedback_record(vocab: Vocabulary, settings: GatewaySettings, ex: Exchange, output: str,
                    upstream_meta: dict, t_first: float | None) -> FeedbackRecord:  # fmt: skip
    """The record of one finished exchange: the prompt through the target's tokenizer (and chat
    template), the output's token ids as the upstream reported them or re-encoded from its text."""
    tok, body = vocab.tokenizer, ex.body
    if ex.chat:
        msgs = [ChatMessage(**m) for m in body.get("messages", [])]
        prompt_ids = chat_prompt_ids(tok, msgs)
    else:
        prompt_ids = tok.encode(str(body.get("prompt", "")))
    out_ids = upstream_meta.get("token_ids") or tok.encode(output)
    now = time.perf_counter()
    meta = upstream_meta.get("adaflash") or {}
    return FeedbackRecord(
        request_id=upstream_meta.get("id") or uuid.uuid4().hex,
        tenant_id=ex.tenant,
        consent=ex.consent,
        domain=_domain(body),
        target_fingerprint=vocab.fingerprint,
        drafter_version=meta.get("drafter_version") or settings.drafter_version,
        method=settings.method,
        block_size=settings.block_size,
        sampling=SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            max_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 16),
            seed=body.get("seed"),
        ),
        prompt_text=tok.decode(prompt_ids),
        output_text=tok.decode(out_ids),
        prompt_token_ids=prompt_ids,
        output_token_ids=out_ids,
        latency=Latency(ttft_ms=((t_first or now) - ex.t0) * 1e3, e2e_ms=(now - ex.t0) * 1e3),
        finish_reason=upstream_meta.get("finish_reason") or "stop",
    )


def response_output(parsed: dict, chat: bool) -> tuple[str, dict]:
    """A plain JSON response's first choice: its text and what the record takes from it."""
    choice = parsed["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    meta = {
        "id": parsed.get("id"),
        "token_ids": choice.get("token_ids"),
        "finish_reason": choice.get("finish_reason"),
        "adaflash": parsed.get("adaflash"),
    }
    return text or "", meta


class StreamOutput:
    """A streamed response's text, token ids and metadata, gathered from its server-sent events
    as the bytes pass through (split anywhere: a partial event waits for the next bytes)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.text: list[str] = []
        self.ids: list[int] = []
        self.meta: dict = {}
        self._buf = b""

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *events, self._buf = self._buf.split(b"\n\n")
        for ev in events:
            line = ev.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            part = json.loads(line[5:])
            meta = self.meta
            meta["id"] = meta.get("id") or part.get("id")
            meta["adaflash"] = part.get("adaflash") or meta.get("adaflash")
            for c in part.get("choices", []):
                delta = c.get("delta", {}).get("content") if self.chat else c.get("text")
                self.text.append(delta or "")
                self.ids.extend(c.get("token_ids") or [])
                meta["finish_reason"] = c.get("finish_reason") or meta.get("finish_reason")

    def output(self) -> tuple[str, dict]:
        self.meta["token_ids"] = self.ids or None
        return "".join(self.text), self.meta


def create_gateway(settings: GatewaySettings, vocab: Vocabulary, send) -> FastAPI:
    """`send(record)` queues a FeedbackRecord (a `FeedbackProducer.send`)."""
    app = FastAPI(title="AdaFlash feedback gateway")
    client = httpx.AsyncClient(base_url=settings.upstream.rstrip("/"), timeout=settings.timeout_s)

    def tenant_of(req: Request) -> str | None:
        auth = req.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        return settings.api_keys.get(key)

    def finished(ex: Exchange, output: Callable[[], tuple[str, dict]], t_first: float | None) -> None:
        """Queue the exchange's record. The client already has its answer: a request the upstream
        accepted but the record cannot be built from (a field of a type the schema refuses) loses
        its record, never the response. Only the error's type is logged: its message may quote
        the request's text."""
        try:
            send(feedback_record(vocab, settings, ex, *output(), t_first))
        except Exception as e:  # noqa: BLE001 - any failure here must stay off the response path
            log.warning("gateway: no feedback record for a %s exchange (%s)", ex.tenant, type(e).__name__)

    async def proxy(req: Request, path: str, chat: bool) -> Response:
        tenant = tenant_of(req)
        if tenant is None:
            return _unauthorized("a valid API key is required (Authorization: Bearer KEY)")
        raw = await req.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # bad JSON, bad UTF-8, nesting past Python's stack
            return error_response(400, "body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object")
        consent = req.headers.get("x-feedback-consent", "true").lower() != "false"
        headers = {"content-type": "application/json", "x-tenant-id": tenant}
        ex = Exchange(body, chat, tenant, consent, time.perf_counter())
        upstream = client.build_request("POST", path, content=raw, headers=headers)
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:  # the upstream is down or timed out: the gateway is fine
            return error_response(502, f"upstream unavailable ({type(e).__name__})", "server_error")
        if not body.get("stream"):
            data = await resp.aread()
            await resp.aclose()
            if resp.status_code == 200:
                finished(ex, lambda: response_output(json.loads(data), chat), None)
            return Response(data, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            out, t_first = StreamOutput(chat), None
            try:
                async for chunk in resp.aiter_raw():
                    t_first = t_first or time.perf_counter()
                    yield chunk  # unchanged, as it arrives
                    out.feed(chunk)
            finally:
                await resp.aclose()
            if resp.status_code == 200:
                finished(ex, out.output, t_first)

        return StreamingResponse(
            relay(), status_code=resp.status_code, media_type=resp.headers.get("content-type")
        )

    @app.post("/v1/completions")
    async def completions(req: Request) -> Response:
        return await proxy(req, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request) -> Response:
        return await proxy(req, "/v1/chat/completions", chat=True)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "upstream": settings.upstream}

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app
