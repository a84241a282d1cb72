"""The embedded MLflow tracking + registry server: SQLite backend store, local artifact store.

`mlflow server` as it is run on one machine (DESIGN §4 field notes): one uvicorn worker and no
job-execution workers (the defaults spawn ~15 processes and 2.6 GB), bound to loopback. Artifacts
are proxied by the server (`mlflow-artifacts:/` URIs), so clients — the registry CLI, the pipeline,
the serving fleet — need nothing but the HTTP address, exactly as with a remote MLflow. A pid file
in `state_dir` lets `start`/`stop`/`status` work across processes (`adaflash up` / `down`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from adaflash.procs import alive, pid_from_file
from adaflash.registry.errors import RegistryUnavailableError

DEFAULT_PORT = 5000


def health(tracking_uri: str, timeout: float = 2.0) -> bool:
    """True when an MLflow server answers `GET /health` with OK at `tracking_uri`."""
    try:
        with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200 and r.read().strip() == b"OK"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


@dataclass
class ServerStatus:
    running: bool  # the process is alive and /health answers
    pid: int | None
    tracking_uri: str
    backend_store: str
    artifacts: str
    log: str


@dataclass
class RegistryServer:
    state_dir: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT

    @property
    def tracking_uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def db_path(self) -> Path:
        return self.state_dir / "mlflow.db"

    @property
    def artifacts_dir(self) -> Path:
        return self.state_dir / "artifacts"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "server.log"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "server.json"

    def _pid(self) -> int | None:
        return pid_from_file(self._pid_file)

    def status(self) -> ServerStatus:
        pid = self._pid()
        return ServerStatus(
            running=pid is not None and health(self.tracking_uri),
            pid=pid,
            tracking_uri=self.tracking_uri,
            backend_store=f"sqlite:///{self.db_path.resolve()}",
            artifacts=str(self.artifacts_dir.resolve()),
            log=str(self.log_file),
        )

    def start(self, timeout: float = 120.0) -> ServerStatus:
        """Start the server unless ours is already running; returns once /health answers."""
        if self._pid() is not None:
            return self._wait_healthy(self._pid(), timeout)
        proc = self.spawn()
        return self._wait_healthy(proc.pid, timeout, proc)

    def spawn(self) -> subprocess.Popen:
        """Start `mlflow server` and record its pid; returns at once (`ready` says when /health
        answers). The stack's supervisor waits on the returned process for its exit status."""
        if _port_open(self.host, self.port):
            raise RegistryUnavailableError(f"port {self.port} is already in use by another process")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.artifacts_dir.mkdir(exist_ok=True)
        mlflow_cli = Path(sys.executable).parent / "mlflow"
        cmd = [str(mlflow_cli)] if mlflow_cli.exists() else [sys.executable, "-m", "mlflow"]
        cmd += [
            "server",
            "--backend-store-uri", f"sqlite:///{self.db_path.resolve()}",
            "--artifacts-destination", str(self.artifacts_dir.resolve()),
            "--host", self.host,
            "--port", str(self.port),
            "--workers", "1",
        ]  # fmt: skip
        env = dict(os.environ)
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no huey workers: 2 processes, not 15
        env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # offline machines; nothing to phone home to
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # Own process group: `mlflow server` forks a uvicorn child, and stop() must end both.
                start_new_session=True,
            )
        self._pid_file.write_text(json.dumps({"pid": proc.pid, "host": self.host, "port": self.port}))
        return proc

    def ready(self) -> bool:
        return health(self.tracking_uri, timeout=1.0)

    def _wait_healthy(self, pid: int, timeout: float, proc: subprocess.Popen | None = None) -> ServerStatus:
        deadline = time.monotonic() + timeout
        while not health(self.tracking_uri, timeout=1.0):
            if proc is not None and proc.poll() is not None:
                self._pid_file.unlink(missing_ok=True)
                raise RegistryUnavailableError(
                    f"MLflow server exited with {proc.returncode}; see {self.log_file}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RegistryUnavailableError(
                    f"MLflow did not answer on {self.tracking_uri} in {timeout:.0f}s; see {self.log_file}"
                )
            time.sleep(0.2)
        return self.status()

    def stop(self, timeout: float = 15.0) -> bool:
        """Stop the server and its worker; returns False if none of ours was running."""
        pid = self._pid()
        if pid is None:
            self._pid_file.unlink(missing_ok=True)
            return False
        try:
            os.killpg(pid, signal.SIGTERM)  # the group: `mlflow server` and its uvicorn worker
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (alive(pid) or _port_open(self.host, self.port)):
            time.sleep(0.05)
        if alive(pid) or _port_open(self.host, self.port):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._pid_file.unlink(missing_ok=True)
        return True
