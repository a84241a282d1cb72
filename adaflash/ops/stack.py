"""`adaflash up` / `down` / `status`: the embedded default stack on one machine.

  broker      Tansu (Kafka wire protocol)                     adaflash.feedback.broker
  registry    MLflow tracking + registry server (SQLite)      adaflash.registry.server
  serve       our engine: OpenAI API, feedback → Kafka, follows the champion
  governance  raw feedback → clean buffer + quarantine + audit
  watcher     runs the training pipeline when enough new clean records exist

Each long-running service is a detached process with a pid file and a log under
`$ADAFLASH_HOME/stack/`, so `down` and `status` work from any shell. Services start in
dependency order and `up` returns only when each answers its health check.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.feedback.broker import Broker
from adaflash.feedback.security import plaintext_env
from adaflash.procs import pid_from_file, terminate
from adaflash.registry.server import RegistryServer


class StackError(AdaFlashError):
    """A stack service failed to start or stop."""


@dataclass
class StackConfig:
    home: Path
    target: str = "smollm2"
    drafter: Path | None = None  # the bootstrap drafter: served until the registry has a champion
    broker_port: int = 9092
    registry_port: int = 5000
    serve_port: int = 8000
    min_records: int = 128
    watch: bool = True
    serve_args: list[str] = field(default_factory=list)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.registry_port}"


@dataclass
class Service:
    """A detached `adaflash ...` process tracked by a pid file."""

    name: str
    argv: list[str]
    state_dir: Path
    health_url: str | None = None

    @property
    def pid_file(self) -> Path:
        return self.state_dir / f"{self.name}.json"

    @property
    def log_file(self) -> Path:
        return self.state_dir / f"{self.name}.log"

    def pid(self) -> int | None:
        return pid_from_file(self.pid_file)

    def healthy(self) -> bool:
        if self.pid() is None:
            return False
        if self.health_url is None:
            return True
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float) -> None:
        if self.pid() is None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_file, "ab") as log:
                proc = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=plaintext_env(),  # every service here talks to the embedded broker
                )
            self.pid_file.write_text(json.dumps({"pid": proc.pid, "argv": self.argv}))
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.pid() is None:
                raise StackError(f"{self.name} exited during start-up; see {self.log_file}")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name} did not become healthy in {timeout:.0f}s; see {self.log_file}")
            time.sleep(0.3)

    def stop(self, timeout: float = 15.0) -> bool:
        pid = self.pid()
        if pid is not None:
            terminate(pid, timeout, group=True)  # the service and anything it forked
        self.pid_file.unlink(missing_ok=True)
        return pid is not None


def _adaflash(*args: str) -> list[str]:
    return [sys.executable, "-m", "adaflash.cli", *args]


class Stack:
    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        d = cfg.home / "stack"
        self.broker = Broker(cfg.home / "broker", port=cfg.broker_port)
        self.registry = RegistryServer(cfg.home / "mlflow", port=cfg.registry_port)  # = `registry server`
        gov = str(cfg.home / "governance")
        serve = ["serve", "--target", cfg.target, "--port", str(cfg.serve_port)]
        serve += ["--bootstrap-servers", cfg.bootstrap_servers, "--follow-registry", cfg.tracking_uri]
        serve += ["--spool-dir", str(cfg.home / "spool"), *cfg.serve_args]
        if cfg.drafter is not None:
            serve += ["--drafter", str(cfg.drafter)]
        self.services = [
            Service("serve", _adaflash(*serve), d, f"http://127.0.0.1:{cfg.serve_port}/health"),
            Service(
                "governance",
                _adaflash(
                    "governance",
                    "run",
                    "--target",
                    cfg.target,
                    "--bootstrap-servers",
                    cfg.bootstrap_servers,
                    "--data-dir",
                    gov,
                ),  # fmt: skip
                d,
            ),
        ]
        if cfg.watch:
            watch = ["pipeline", "watch", "--target", cfg.target, "--data-dir", gov, "--min-records"]
            watch += [str(cfg.min_records), "--tracking-uri", cfg.tracking_uri]
            watch += ["--bootstrap-servers", cfg.bootstrap_servers]
            if cfg.drafter is not None:
                watch += ["--fallback-drafter", str(cfg.drafter)]
            self.services.append(Service("watcher", _adaflash(*watch), d))

    @property
    def _layout(self) -> Path:
        """What `up` started (`down` and `status` only know the ports they are given)."""
        return self.cfg.home / "stack-layout.json"  # beside, not among, the pid files

    def up(self, timeout: float = 180.0, progress=lambda name: None) -> None:
        self._layout.parent.mkdir(parents=True, exist_ok=True)
        self._layout.write_text(json.dumps({"watch": self.cfg.watch}))
        progress("broker")
        self.broker.start()
        progress("registry")
        self.registry.start()
        for s in self.services:
            progress(s.name)
            s.start(timeout)

    def down(self) -> list[str]:
        stopped = [s.name for s in reversed(self.services) if s.stop()]
        if self.registry.stop():
            stopped.append("registry")
        if self.broker.stop():
            stopped.append("broker")
        return stopped

    def status(self) -> list[dict]:
        b, r = self.broker.status(), self.registry.status()
        rows = [
            {"service": "broker", "running": b["running"], "pid": b["pid"], "where": b["bootstrap_servers"]},
            {"service": "registry", "running": r.running, "pid": r.pid, "where": r.tracking_uri},
        ]
        started_watcher = True
        if self._layout.exists():
            started_watcher = json.loads(self._layout.read_text()).get("watch", True)
        for s in self.services:
            if s.name == "watcher" and not started_watcher:
                continue  # `up --no-watch`: not part of this stack, so never "down"
            where = s.health_url.rsplit("/", 1)[0] if s.health_url else str(s.log_file)
            rows.append({"service": s.name, "running": s.healthy(), "pid": s.pid(), "where": where})
        return rows
