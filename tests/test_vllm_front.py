"""The vLLM replica set's front port (adaflash/serving/vllm_fleet.py): the switch a rolling restart
makes. Runs without vLLM: two plain HTTP servers stand in for the old and the new replica's port."""

from __future__ import annotations

import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from adaflash.serving.vllm_fleet import Front


def _server(name: str, delay: float = 0.0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(delay)
            body = name.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
        return r.read().decode()


def test_front_switches_new_connections_and_lets_open_ones_finish():
    old, new = _server("old", delay=1.0), _server("new")
    front = Front("127.0.0.1", 0)
    try:
        front.point_at(old.server_port)
        assert _get(front.port) == "old"
        slow = []
        t = threading.Thread(target=lambda: slow.append(_get(front.port)))
        t.start()  # a request in flight on the old replica while the front switches
        deadline = time.monotonic() + 5
        while front.open_connections(old.server_port) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        front.point_at(new.server_port)
        assert _get(front.port) == "new"  # new connections reach the new replica at once
        t.join(10)
        assert slow == ["old"]  # the open one finished where it started
        deadline = time.monotonic() + 5
        while front.open_connections(old.server_port) or front.open_connections(new.server_port):
            assert time.monotonic() < deadline, front.active  # drained: the old replica may stop
            time.sleep(0.01)
    finally:
        front.close()
        old.shutdown()
        new.shutdown()
