"""`adaflash up` / `down` / `status`: the embedded default stack on one machine.

  broker      Tansu (Kafka wire protocol)                     adaflash.feedback.broker
  registry    MLflow tracking + registry server (SQLite)      adaflash.registry.server
  serve       our engine: OpenAI API, feedback → Kafka, follows the champion
  governance  raw feedback → clean buffer + quarantine + audit
  watcher     runs the training pipeline when enough new clean records exist
  supervisor  starts the five above in dependency order and restarts one that dies (`supervisor.py`)

`up` writes what it is asked to run to `$ADAFLASH_HOME/stack-layout.json` and starts the
supervisor, a detached process that starts each service (a pid file and a log under
`$ADAFLASH_HOME/stack/`, the broker's and MLflow's under their own directories) and restarts one
that dies, with backoff. `up` returns once every service passes its health check. `down` stops the
supervisor first, then the services in reverse order, so nothing restarts what it stopped;
`status` shows each service with its restarts, last exit and next restart. All three work from any
shell: the pid files are the truth.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.feedback.broker import PLAINTEXT, Broker, ensure_topics
from adaflash.feedback.security import plaintext_env
from adaflash.ops.supervisor import RestartPolicy, Supervisor, Unit, read_state
from adaflash.paths import governance_dir
from adaflash.procs import alive, pid_from_file, terminate
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
    policy: RestartPolicy = field(default_factory=RestartPolicy)

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "home": str(self.home),
            "drafter": str(self.drafter) if self.drafter else None,
        }

    @classmethod
    def from_json(cls, d: dict) -> StackConfig:
        d = dict(d)
        d["home"] = Path(d["home"])
        d["drafter"] = Path(d["drafter"]) if d.get("drafter") else None
        d["policy"] = RestartPolicy(**d.get("policy", {}))
        return cls(**d)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.registry_port}"


def _suffix_cache_of(health_url: str | None) -> dict | None:
    """The server's fast learner as its /health reports it (size, tenants, last clean offsets)."""
    if health_url is None:
        return None
    try:
        with urllib.request.urlopen(health_url, timeout=2) as r:
            return json.loads(r.read()).get("suffix_cache")
    except (OSError, ValueError):
        return None


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

    def ready(self) -> bool:
        """The health check alone, without the pid file (the supervisor knows its child)."""
        if self.health_url is None:
            return True
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def healthy(self) -> bool:
        return self.pid() is not None and self.ready()

    def spawn(self) -> subprocess.Popen:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: stop() ends it and whatever it forked
                env=plaintext_env(),  # every service here talks to the embedded broker
            )
        self.pid_file.write_text(json.dumps({"pid": proc.pid, "argv": self.argv}))
        return proc

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
        gov = str(governance_dir(cfg.home))
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
        """What `up` started: the supervisor reads its config here, `status` whether the watcher
        is part of the stack (`down` and `status` only know the ports they are given)."""
        return self.cfg.home / "stack-layout.json"  # beside, not among, the pid files

    @property
    def supervisor_file(self) -> Path:
        """The supervisor's pid file, with each service's state (`supervisor.py`)."""
        return self.cfg.home / "stack" / "supervisor.json"

    def units(self) -> list[Unit]:
        """The services in dependency order, as the supervisor starts them."""
        b, r = self.broker, self.registry
        topics = partial(ensure_topics, b.bootstrap_servers, security=PLAINTEXT)
        units = [
            Unit("broker", b.spawn, b.ready, b._pid, topics),
            Unit("registry", r.spawn, r.ready, r._pid),
        ]
        return units + [Unit(s.name, s.spawn, s.ready, s.pid) for s in self.services]

    def supervise(self) -> None:
        """Run the supervisor in this process until SIGTERM (what `up` starts in the background)."""
        Supervisor(self.units(), self.cfg.policy, self.supervisor_file).run()

    def _supervisor_pid(self) -> int | None:
        return pid_from_file(self.supervisor_file)

    def _start_supervisor(self) -> int:
        d = self.supervisor_file.parent
        d.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "ADAFLASH_HOME": str(self.cfg.home)}
        with open(d / "supervisor.log", "ab") as log:
            proc = subprocess.Popen(
                _adaflash("supervise"),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # outlives this CLI; `down` stops it
            )
        self.supervisor_file.write_text(json.dumps({"pid": proc.pid}))  # it rewrites this with state
        return proc.pid

    def up(self, timeout: float = 180.0, progress=lambda name: None) -> None:
        """Start the supervisor (or ask the running one to retry what is not running) and wait
        until every service is up; a service that fails to start raises with its log. `timeout`
        bounds each wait for a service that is not starting (waiting, backing off); a start in
        progress is the supervisor's to bound, by its progress (`RestartPolicy`)."""
        pid = self._supervisor_pid()
        gen = 0
        if pid is None:
            self._layout.parent.mkdir(parents=True, exist_ok=True)
            self._layout.write_text(json.dumps({"watch": self.cfg.watch, "config": self.cfg.to_json()}))
            pid = self._start_supervisor()
        else:
            gen = read_state(self.supervisor_file).get("generation", 0) + 1
            os.kill(pid, signal.SIGHUP)  # retry anything that gave up or exited
        deadline = time.monotonic() + timeout
        for name in [u.name for u in self.units()]:
            progress(name)
            while True:
                if not alive(pid):
                    raise StackError(
                        f"the stack's supervisor exited; see {self.supervisor_file.parent}/supervisor.log"
                    )
                st = read_state(self.supervisor_file)
                svc = st.get("services", {}).get(name, {})
                if st.get("generation", 0) >= gen:  # the state answers this `up`'s retry
                    if svc.get("state") == "running":
                        break
                    if svc.get("state") == "gave up":
                        raise StackError(f"{name}: {svc.get('note')}; see {self._log_of(name)}")
                    if svc.get("state") == "starting":  # still working: the supervisor bounds a
                        deadline = time.monotonic() + timeout  # start (RestartPolicy), not this wait
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{name} did not become healthy in {timeout:.0f}s; see {self._log_of(name)}"
                    )
                time.sleep(0.2)

    def _log_of(self, name: str) -> Path:
        logs = {"broker": self.broker.log_file, "registry": self.registry.log_file}
        logs.update({s.name: s.log_file for s in self.services})
        return logs[name]

    def down(self) -> list[str]:
        """The supervisor first (it exits without starting anything), then the services."""
        stopped = []
        pid = self._supervisor_pid()
        if pid is not None:
            terminate(pid, 30.0)  # it waits for a start in progress to record its pid
            stopped.append("supervisor")
        self.supervisor_file.unlink(missing_ok=True)
        stopped += [s.name for s in reversed(self.services) if s.stop()]
        if self.registry.stop():
            stopped.append("registry")
        if self.broker.stop():
            stopped.append("broker")
        return stopped

    def status(self) -> list[dict]:
        """One row per service: running, pid, where, and what the supervisor knows of it."""
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
        sup_pid = self._supervisor_pid()
        state = read_state(self.supervisor_file) if sup_pid is not None else {}
        for row in rows:
            svc = state.get("services", {}).get(row["service"], {})
            row["restarts"] = svc.get("restarts", 0)
            row["last_exit"] = svc.get("last_exit")
            row["state"] = svc.get("state")
            row["next_restart_at"] = svc.get("next_restart_at")
            row["note"] = svc.get("note")
        where = str(self.supervisor_file.parent / "supervisor.log")
        rows.append({"service": "supervisor", "running": sup_pid is not None, "pid": sup_pid, "where": where})
        serve = next((s for s in self.services if s.name == "serve"), None)
        for row in rows:
            if serve is not None and row["service"] == "serve" and row["running"]:
                row["suffix_cache"] = _suffix_cache_of(serve.health_url)
        return rows
