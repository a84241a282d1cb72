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
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server and the gateway's pool

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


def test_front_moves_kept_alive_connections_between_requests_and_drains_the_old_server():
    import http.client

    old, new = _server("old", delay=1.0), _server("new")
    front = Front("127.0.0.1", 0)

    def ask(c: http.client.HTTPConnection) -> str:
        c.request("GET", "/")
        return c.getresponse().read().decode()

    try:
        front.point_at(old.server_port)
        pooled, idle = (http.client.HTTPConnection("127.0.0.1", front.port, timeout=10) for _ in range(2))
        assert ask(pooled) == "old" and ask(idle) == "old"  # two kept-alive connections on the old server
        slow = []
        t = threading.Thread(target=lambda: slow.append(_get(front.port)))
        t.start()  # an exchange in flight on the old server while the front switches
        deadline = time.monotonic() + 5
        while front.open_connections(old.server_port) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        front.point_at(new.server_port)
        assert ask(pooled) == "new"  # the next request on a kept-alive connection goes to the new server
        waited = front.retire(old.server_port, quiet_s=0.2)
        t.join(10)
        assert slow == ["old"] and waited >= 0.5  # retire waited for the exchange in flight
        assert front.open_connections(old.server_port) == 0  # the idle connection moved too
        old.shutdown()
        old.server_close()
        assert ask(idle) == "new" and ask(pooled) == "new"  # stopping the old server closed no client
    finally:
        front.close()
        new.shutdown()
