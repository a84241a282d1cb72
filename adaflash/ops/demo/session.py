"""The demo's state and how it talks to the services: the embedded stack it started, the
OpenAI API, the registry, and waiting for a service to reach a state."""

from __future__ import annotations

import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from adaflash.feedback.broker import free_port
from adaflash.ops.demo.config import ScenarioConfig, ScenarioError
from adaflash.paths import governance_dir
from adaflash.procs import cpu_seconds


def http_json(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 300) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextmanager
def output_to(path: Path):
    """Send this process's stdout/stderr (and its subprocesses') to `path` for the duration:
    kfp.local streams every component's executor output, which drowns the demo's story."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def wait(what: str, check: Callable[[], object], timeout: float, every: float = 0.5, alive=lambda: None):
    deadline = time.monotonic() + timeout
    while True:
        alive()  # raises as soon as a service the wait depends on has died
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise ScenarioError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


class Session:
    """One demo run's stack, console and what the steps hand on to later ones (the planted PII
    values, the fresh prompts)."""

    def __init__(self, cfg: ScenarioConfig, console: Console) -> None:
        from adaflash.ops.stack import Stack, StackConfig

        self.cfg, self.console = cfg, console
        # MLflow's INFO lines would interleave the story; it reads the level when first imported.
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        self.rng = random.Random(cfg.seed)
        ports = {k: cfg.ports.get(k) or free_port() for k in ("broker", "registry", "serve")}
        self.stack = Stack(
            StackConfig(
                home=cfg.home.resolve(),
                target=cfg.target,
                drafter=cfg.drafter.resolve(),
                broker_port=ports["broker"],
                registry_port=ports["registry"],
                serve_port=ports["serve"],
                watch=False,  # the demo runs the pipeline itself, in the foreground
                serve_args=["--gamma", str(cfg.gamma)],
            )
        )
        self.base = f"http://127.0.0.1:{ports['serve']}"
        self.canaries: list[str] = []  # every planted PII value: none may be found at rest
        self.fresh: list[tuple[str, str]] = []  # (domain, prompt) served by each version, in no snapshot

    @property
    def gov_dir(self) -> Path:
        return governance_dir(self.cfg.home.resolve())

    def step(self, title: str) -> None:
        self.console.rule(f"[bold]{title}")

    def assert_alive(self) -> None:
        for svc in self.stack.services:
            if svc.pid() is None:
                tail = svc.log_file.read_text(errors="replace").strip().splitlines()[-3:]
                raise ScenarioError(f"{svc.name} exited; see {svc.log_file}: " + " | ".join(tail))

    def serving_version(self) -> str | None:
        return http_json(self.base + "/health", timeout=10).get("drafter_version")

    def wait_version(self, version: str) -> float:
        t = time.monotonic()
        wait(
            f"the server to serve drafter v{version}",
            lambda: self.serving_version() == version,
            120,
            alive=self.assert_alive,
        )
        return time.monotonic() - t

    def registry(self):
        from adaflash.models.targets import load_vocabulary
        from adaflash.registry.client import RegistryClient

        c = self.stack.cfg
        return RegistryClient(
            c.tracking_uri, load_vocabulary(c.target).fingerprint, bootstrap_servers=c.bootstrap_servers
        )

    def chat(
        self,
        tenant: str,
        dom: str,
        text: str,
        consent: bool = True,
        method: str | None = None,
        cache: bool = True,
    ) -> dict:
        body = {
            "model": "adaflash",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": 0,
        }
        if method is not None:
            body["method"] = method
        headers = {"X-Tenant-Id": tenant, "X-Domain": dom, "X-Feedback-Consent": str(consent).lower()}
        if not cache:
            headers["X-Suffix-Cache"] = "off"
        return http_json(self.base + "/v1/chat/completions", body, headers)

    def server_cpu_seconds(self) -> float | None:
        """CPU time of the serving process so far (Linux /proc): on a shared machine tokens per
        server CPU-second compare two drafters where wall-clock tok/s also measures the neighbours."""
        pid = next(s.pid() for s in self.stack.services if s.name == "serve")
        return cpu_seconds(pid) if pid is not None else None
