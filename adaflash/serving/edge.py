"""The HTTP edge: what a client can make the server read, and for how long, before a handler runs.

Without limits one client can stall every other: a 100 MB body is read, parsed and tokenised on
the event loop (`/health` freezes for 20 s), and idle or half-sent connections stay open forever
(300 of them exhaust a 256-descriptor limit and the server becomes unreachable).

- `BodyLimit` (ASGI middleware) refuses a body over `max_body_bytes` with an OpenAI-shaped 413:
  at once when Content-Length says so, before a byte of it is read; else (chunked uploads) as soon
  as the bytes read pass the limit. It reads the whole body under a deadline (`body_timeout_s`,
  408 past it) and hands it to the app in one piece, so handlers never wait on a slow client.
- `TimedH11Protocol` (uvicorn's h11 protocol) closes a connection whose request headers are not
  complete `header_timeout_s` after it opened (or after its previous response, on a kept-alive
  connection): a total deadline, so trickling a byte at a time does not extend it.
- Kept-alive connections idle longer than `keep_alive_s` are closed by uvicorn itself.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from adaflash.serving.protocol import error_response


@dataclass(frozen=True)
class EdgeLimits:
    max_body_bytes: int = 8 * 1024 * 1024  # a 2,048-token request is ~100 KB: generous headroom
    header_timeout_s: float = 10.0  # connection open → request headers complete
    body_timeout_s: float = 30.0  # request headers → body complete
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _declared_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 has already refused a malformed Content-Length
    return None


class BodyLimit:
    """ASGI middleware: the body is read here, bounded in size and time, then replayed to `app`."""

    def __init__(self, app, limits: EdgeLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            return await self._refuse(scope, receive, send, 413, f"request body of {declared} bytes exceeds "
                                      f"the server's limit of {limit} bytes")  # fmt: skip
        try:
            body = await asyncio.wait_for(self._read(receive, limit), self.limits.body_timeout_s)
        except _TooLarge:
            return await self._refuse(scope, receive, send, 413, f"request body exceeds the server's limit "
                                      f"of {limit} bytes")  # fmt: skip
        except TimeoutError:
            return await self._refuse(scope, receive, send, 408, f"request body not received within "
                                      f"{self.limits.body_timeout_s:g} s")  # fmt: skip
        except _ClientGone:
            return None  # nobody to answer
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    async def _read(receive, limit: int) -> bytes:
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:  # stop reading: the rest of a chunked upload is never buffered
                raise _TooLarge
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str) -> None:
        # Connection: close — the unread rest of the body must not be parsed as a next request.
        response = error_response(status, message, code="request_too_large" if status == 413 else "timeout",
                                  headers={"Connection": "close"})  # fmt: skip
        await response(scope, receive, send)


def _replay(body: bytes, receive):
    """The app's `receive`: the buffered body first, then the connection's own events (a
    disconnect while the request is served)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a total deadline for each request's headers."""

    def __init__(self, *args, header_timeout_s: float = 10.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._header_deadline = self.loop.call_later(self._header_timeout_s, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        # On a kept-alive connection the next request's clock starts with its first byte (until
        # then uvicorn's keep-alive timeout applies).
        if self._header_deadline is None and self._awaiting_headers():
            self._arm()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()  # the keep-alive timeout takes over until the next request's first byte
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, host: str, port: int, limits: EdgeLimits):
    """The uvicorn config every server of ours runs with: `app` behind `BodyLimit`, the timed
    protocol, the keep-alive timeout."""
    import uvicorn

    return uvicorn.Config(
        BodyLimit(app, limits),
        host=host,
        port=port,
        log_level="warning",
        http=functools.partial(TimedH11Protocol, header_timeout_s=limits.header_timeout_s),
        timeout_keep_alive=max(1, round(limits.keep_alive_s)),
    )
