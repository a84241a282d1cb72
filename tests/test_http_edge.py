"""The HTTP edge holds against one client (issue 32): a 100 MB body is refused with a 413 before
it is read while /health keeps answering; a large body under the limit is parsed and tokenised
off the event loop; non-streaming requests whose clients gave up are cancelled, not run to
max_tokens; idle and half-sent connections are closed, so they cannot use up the server's file
descriptors. Real servers, raw sockets where a well-behaved client library would not misbehave."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlparse

import httpx
import pytest

from adaflash.feedback.broker import free_port
from adaflash.serving.edge import EdgeLimits
from adaflash.serving.engine import Engine, EngineConfig
from adaflash.serving.server import ServerSettings, ServerThread, create_app

MB = 1024 * 1024
JSON = {"Content-Type": "application/json"}


@contextmanager
def edge_server(target, limits: EdgeLimits | None = None, **cfg):
    engine = Engine(target, None, EngineConfig(method="ar", **cfg))
    engine.start()
    settings = ServerSettings(edge=limits or EdgeLimits())
    srv = ServerThread(create_app(engine, settings), port=free_port()).start()
    try:
        yield engine, srv
    finally:
        srv.stop()
        engine.stop()


@pytest.fixture(scope="module")
def server(tiny32):
    with edge_server(tiny32, max_running=4, max_queue=64) as s:
        yield s


def _address(url: str) -> tuple[str, int]:
    u = urlparse(url)
    return u.hostname, u.port


def _status(sock: socket.socket, timeout: float) -> tuple[int, bytes]:
    """Read one HTTP response's status and whatever of it arrived within `timeout`."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


class HealthProbe:
    """Times GET /health in a loop on its own thread while a test does something heavy."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert c.get(self.url + "/health").status_code == 200
                self.latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def _send_forever(sock: socket.socket, total: int, chunk: bytes, chunked: bool = False) -> None:
    """Upload `total` bytes (a sender thread); stops quietly when the server closes the socket."""
    try:
        sent = 0
        while sent < total:
            piece = b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk
            sock.sendall(piece)
            sent += len(chunk)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass


def _post_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}\r\n").encode()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_100mb_body_gets_413_at_once_and_health_keeps_answering(server, chunked):
    engine, srv = server
    total = 100 * MB
    extra = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n"
    with HealthProbe(srv.url) as probe, socket.create_connection(_address(srv.url)) as sock:
        time.sleep(0.2)  # a few /health answers before the upload
        t0 = time.perf_counter()
        sock.sendall(_post_head("/v1/completions", extra))
        sender = threading.Thread(target=_send_forever, args=(sock, total, b"7" * MB, chunked), daemon=True)
        sender.start()
        status, rest = _status(sock, timeout=30)
        took = time.perf_counter() - t0
        time.sleep(0.3)  # and /health once more after it
    sender.join(30)
    assert status == 413, (status, rest[:200])
    assert took < 1.0, f"the 413 took {took:.2f} s"
    assert max(probe.latencies) < 1.0, probe.latencies
    with httpx.Client(base_url=srv.url, timeout=30) as c:  # and the server still serves
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    assert engine.failure is None


def test_the_413_is_an_openai_error_object(server):
    _, srv = server
    with socket.create_connection(_address(srv.url)) as sock:
        sock.sendall(_post_head("/v1/chat/completions", f"Content-Length: {9 * MB}\r\n"))
        status, rest = _status(sock, timeout=10)
        while not rest.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    assert status == 413
    err = json.loads(rest)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert str(8 * MB) in err["message"]


@pytest.mark.parametrize("kind", ["token ids", "chat text"])
def test_a_large_body_under_the_limit_is_parsed_off_the_event_loop(server, kind):
    """Just under 8 MB: millions of token ids (or characters) to validate, check and tokenise.
    /health answers meanwhile, and the request gets its 400 (far past the context)."""
    _, srv = server
    if kind == "token ids":
        path, body = "/v1/completions", {"prompt": [7] * (5 * MB // 2), "max_tokens": 4}
    else:
        message = {"role": "user", "content": "a b " * (MB + MB // 2)}
        path, body = "/v1/chat/completions", {"messages": [message]}
    data = json.dumps(body).encode()
    assert 6 * MB < len(data) < 8 * MB
    results: list[httpx.Response] = []
    with HealthProbe(srv.url) as probe:
        time.sleep(0.2)

        def post() -> None:
            results.append(httpx.post(srv.url + path, content=data, headers=JSON, timeout=120))

        sender = threading.Thread(target=post, daemon=True)
        sender.start()
        sender.join(120)
        time.sleep(0.2)
    assert results and results[0].status_code == 400, results and results[0].text[:300]
    assert "exceeds" in results[0].json()["error"]["message"]
    assert max(probe.latencies) < 1.0, sorted(probe.latencies)[-5:]


def test_abandoned_non_streaming_requests_are_cancelled(tiny32):
    """Clients that give up on a plain (non-streaming) request free its slot: the requests are
    cancelled (none finishes), and a fresh request is served at once instead of queueing behind
    work nobody waits for. Generating 900 tokens x 8 takes several seconds here."""
    finished: list[str] = []
    with edge_server(tiny32, max_running=4, max_queue=64) as (engine, srv):
        engine.observers.append(lambda r: finished.append(r.request_id))

        async def give_up() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=0.3) as c:
                body = {"prompt": "go on", "max_tokens": 900, "temperature": 0}
                results = await asyncio.gather(
                    *(c.post("/v1/completions", json=body) for _ in range(8)), return_exceptions=True
                )
            assert all(isinstance(r, httpx.TimeoutException) for r in results), results

        asyncio.run(give_up())
        deadline = time.monotonic() + 3.0
        while not engine.idle and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.idle, f"{len(engine.scheduler.running)} abandoned requests still running"
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "temperature": 0},
                       timeout=60)  # fmt: skip
        fresh = time.perf_counter() - t0
        assert r.status_code == 200 and fresh < 1.0, fresh
        assert len(finished) == 1, f"{len(finished) - 1} abandoned requests ran to the end"


IDLE_SERVER = """
import resource, sys, time, torch
from adaflash.models.targets import tiny_target
from adaflash.serving.edge import EdgeLimits
from adaflash.serving.engine import Engine, EngineConfig
from adaflash.serving.server import ServerSettings, ServerThread, create_app

resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
engine = Engine(tiny_target(torch.float32), None, EngineConfig(method="ar"))
engine.start()
limits = EdgeLimits(header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=1.0)
ServerThread(create_app(engine, ServerSettings(edge=limits)), port=int(sys.argv[1])).start()
print("ready", flush=True)
time.sleep(600)
"""


def test_idle_connections_cannot_make_the_server_unreachable():
    """A server limited to 128 file descriptors, 200 connections that never finish a request
    (silent, half-sent headers, half-sent body): each is closed when its deadline passes, so the
    server keeps accepting and /health answers within a few seconds."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", IDLE_SERVER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    socks: list[socket.socket] = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        half_body = _post_head("/v1/completions", "Content-Length: 100\r\n") + b'{"pro'
        partial = [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n", half_body]
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", port))
            if partial[i % 3]:
                s.sendall(partial[i % 3])
            socks.append(s)
        time.sleep(0.5)
        t0 = time.perf_counter()
        r = httpx.get(url + "/health", timeout=15)
        took = time.perf_counter() - t0
        assert r.status_code == 200 and took < 8.0, took
        time.sleep(1.5)  # every idle connection has had its deadline by now: all closed
        still_open = 0
        for s in socks:
            s.settimeout(3.0)
            try:
                while s.recv(65536):  # a 408 for the half-sent body, then the close
                    pass
            except TimeoutError:
                still_open += 1
            except OSError:
                pass
        assert still_open == 0, f"{still_open} of {len(socks)} idle connections still open"
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(10)
