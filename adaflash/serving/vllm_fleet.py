"""A vLLM replica set that follows the champion by rolling restart (issue 36).

vLLM's runtime draft-weight update (`VLLM_SERVER_DEV_MODE=1`: `/start_draft_weight_update`,
`/update_weights`, `/finish_weight_update`) moves weights over a GPU transport (NCCL) only, so on
CPU a new drafter means a new server. To keep serving while it starts (90-150 s here), the set
keeps a stable front port (`Front`, a TCP forwarder: what a Kubernetes Service does for the
`vllm` Deployment's rolling update) and, on every champion change:

  1. downloads the version from the configured registry and exports it for vLLM (`--format vllm`);
  2. starts a second server with the new `--speculative-config` on a fresh port, waits for
     /health and one completion;
  3. points the front at it (new connections go there; open ones finish on the old server);
  4. stops the old server once its exchanges in flight have finished (`Front.retire`: kept-alive
     client connections move to the new server between requests).

The switch itself (step 3) is a pointer swap; `switches` records how long each step took.
If vLLM cannot start with the drafter (the export does not load), the set falls back to `ngram`
and logs vLLM's own error, so the fleet keeps serving.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from adaflash.errors import AdaFlashError

log = logging.getLogger(__name__)


class Front:
    """A TCP forwarder on a stable port to whichever upstream port is current.

    Clients keep HTTP/1.1 connections alive (the gateway's pool does), so switching only new
    connections would leave them on the old server forever. A connection is moved between
    requests instead: when a client sends bytes after a response has begun on its connection,
    the previous exchange is over (HTTP/1.1 clients here do not pipeline), so the request goes to
    the current upstream on a fresh upstream connection. `retire` waits for the old server's
    exchanges in flight and moves its idle connections, so stopping it closes no client's socket."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self.upstream: int | None = None
        self.conns: set[_Conn] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="vllm-front").start()

    def point_at(self, port: int) -> None:
        with self._lock:
            self.upstream = port

    def open_connections(self, port: int) -> int:
        with self._lock:
            return sum(c.port == port for c in self.conns)

    def retire(self, port: int, quiet_s: float = 2.0, timeout: float = 300.0) -> float:
        """Wait until no exchange is in flight on `port` (a response begun and quiet for `quiet_s`),
        then move its idle connections to the current upstream. Returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with self._lock:
                busy = [c for c in self.conns if c.port == port and not c.idle(quiet_s)]
            if not busy:
                break
            time.sleep(0.1)
        with self._lock:
            idle = [c for c in self.conns if c.port == port]
        for c in idle:
            c.move_if_idle(quiet_s)
        return time.monotonic() - t0

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            port = self.upstream
            if port is None:
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client, port), daemon=True).start()

    def _serve(self, client: socket.socket, port: int) -> None:
        try:
            conn = _Conn(self, client, port)
        except OSError:
            client.close()
            return
        with self._lock:
            self.conns.add(conn)
        try:
            conn.run()
        finally:
            with self._lock:
                self.conns.discard(conn)


class _Conn:
    """One client connection and its current upstream connection."""

    def __init__(self, front: Front, client: socket.socket, port: int) -> None:
        self.front, self.client, self.port = front, client, port
        self.up = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.up.settimeout(None)
        self.responded = False  # upstream bytes since the client's last request bytes
        self.last_up = time.monotonic()
        self.lock = threading.Lock()

    def idle(self, quiet_s: float) -> bool:
        return self.responded and time.monotonic() - self.last_up >= quiet_s

    def run(self) -> None:
        self._back(self.up)
        try:
            while data := self.client.recv(65536):
                with self.lock:
                    if self.responded and self.front.upstream not in (None, self.port):
                        self._move(self.front.upstream)
                    self.responded = False
                    up = self.up
                up.sendall(data)
        except OSError:
            pass
        finally:
            for s in (self.client, self.up):
                _close(s)

    def move_if_idle(self, quiet_s: float) -> None:
        with self.lock:
            target = self.front.upstream
            if self.idle(quiet_s) and target not in (None, self.port):
                self._move(target)

    def _move(self, port: int) -> None:  # holds self.lock
        old = self.up
        self.up = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.up.settimeout(None)
        self.port = port
        _close(old)  # its reader sees it is no longer current and leaves the client open
        self._back(self.up)

    def _back(self, up: socket.socket) -> None:
        threading.Thread(target=self._relay_back, args=(up,), daemon=True).start()

    def _relay_back(self, up: socket.socket) -> None:
        try:
            while data := up.recv(65536):
                with self.lock:
                    self.responded, self.last_up = True, time.monotonic()
                self.client.sendall(data)
        except OSError:
            pass
        with self.lock:
            current = up is self.up
        if current:  # the server closed the connection: so does the front, to the client
            _close(self.client)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@dataclass
class Switch:
    version: str
    method: str  # what vLLM runs: dflash, or ngram where the drafter did not load
    export_s: float
    start_s: float  # new server: start to /health + one completion
    drain_s: float  # old server: front switched to its last exchange finished
    total_s: float
    fallback_reason: str | None = None


@dataclass
class VllmReplicas:
    """The serving side: one live vLLM behind `front`, replaced on every champion change."""

    model_path: str
    drafter_dir: Path
    python: str
    front: Front
    block_size: int = 8
    method: str = "dflash"
    served_model_name: str = "adaflash"
    args: list[str] = field(default_factory=list)  # more vLLM server arguments
    log_dir: Path = Path(".adaflash/vllm")
    live: object | None = None  # VllmServer
    live_version: str | None = None
    switches: list[Switch] = field(default_factory=list)

    def apply(self, version: str, drafter_src: Path) -> Switch:
        """Serve `drafter_src` (a downloaded drafter) as `version`; the old server keeps serving meanwhile."""
        from adaflash.serving.export import export_drafter

        t0 = time.monotonic()
        out = self.drafter_dir / f"v{version}-vllm"
        exp = export_drafter(drafter_src, out, fmt="vllm", target_dir=self.model_path)
        t1 = time.monotonic()
        reason = None
        try:
            new, method = self._start(self.method, str(exp.path), exp.block_size, version), self.method
        except AdaFlashError as e:
            if self.method != "dflash":
                raise
            reason = f"vLLM did not start with the exported drafter; serving ngram instead: {e}"
            log.warning(reason)
            new, method = self._start("ngram", None, exp.block_size, version), "ngram"
        t2 = time.monotonic()
        old = self.live
        self.front.point_at(new.port)
        self.live, self.live_version = new, version
        drain_s = self._retire(old)
        sw = Switch(version, method, t1 - t0, t2 - t1, drain_s, time.monotonic() - t0, reason)
        self.switches.append(sw)
        return sw

    def _start(self, method: str, drafter: str | None, block_size: int, version: str):
        from adaflash.serving.export_vllm import speculative_config, vllm_launch_argv
        from adaflash.serving.vllm_engine import VllmServer, complete

        port = _free_port()
        argv = vllm_launch_argv(self.model_path, speculative_config(method, drafter, block_size),
                                python=self.python, host="127.0.0.1", port=port,
                                served_model_name=self.served_model_name, extra=self.args)  # fmt: skip
        server = VllmServer(argv, port, self.log_dir / f"vllm-v{version}-{method}-{port}.log").start()
        try:
            server.wait_ready()
            complete(server.url, self.served_model_name, [1, 2, 3], 4)  # warm: the first request compiles
        except Exception:
            server.stop()
            raise
        return server

    def _retire(self, old) -> float:
        if old is None:
            return 0.0
        drained = self.front.retire(old.port)
        old.stop()
        return drained

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
        self.front.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
