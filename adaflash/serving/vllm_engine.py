"""vLLM as a serving engine of the fleet (issue 36): a server process, its readiness and metrics.

vLLM runs from its own virtualenv (`make vllm`: `.venv-vllm`), never imported here: its pins
(transformers, fastapi, ...) are not ours. A server is `python -m vllm.entrypoints.openai.api_server`
(`export_vllm.vllm_launch_argv`), started in its own process group so stopping it stops its engine
core process too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from adaflash.errors import AdaFlashError

DEFAULT_VENV = Path(".venv-vllm")
# CPU build: the KV cache is host memory (GiB); 1 GiB holds ~ 45k tokens of SmolLM2-135M in fp32.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}


def vllm_python(venv: Path | str | None = None) -> Path:
    """The interpreter of the vLLM virtualenv, or an error that says how to build it."""
    venv = Path(venv or os.environ.get("ADAFLASH_VLLM_VENV", DEFAULT_VENV))
    py = venv / "bin" / "python"
    if not (venv / ".vllm-installed").exists() or not py.exists():
        raise AdaFlashError(f"no vLLM virtualenv at {venv}: build it with `make vllm`")
    return py


@dataclass
class VllmServer:
    """One `vllm.entrypoints.openai.api_server` process on `port`."""

    argv: list[str]
    port: int
    log_path: Path
    env: dict = field(default_factory=dict)
    nice: int = 10  # it takes both cores while it compiles and serves: others come first
    name: str = "vLLM"  # in errors (the serving bench starts `adaflash serve` the same way)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **CPU_ENV, **self.env}
        more = self.nice - os.nice(0)  # `nice` is the server's niceness, not an increment on ours
        argv = ["nice", "-n", str(more), *self.argv] if more > 0 else list(self.argv)
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Seconds from start to a 200 on /health; raises with the log's tail if it dies or times out."""
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AdaFlashError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        self.ready_at = time.monotonic()
                        return self.ready_at - self.started_at
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise AdaFlashError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the process group (API server + engine core), SIGKILL after `grace` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)


def spec_decode_metrics(url: str) -> dict:
    """vLLM's speculative-decoding counters from /metrics: drafts (verify rounds), draft and
    accepted tokens, and the mean acceptance length 1 + accepted / drafts (the bonus token counts)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        vals = re.findall(rf"^vllm:spec_decode_{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[name] = sum(float(v) for v in vals)
    out["mean_acceptance_length"] = (
        1 + out["num_accepted_tokens"] / out["num_drafts"] if out["num_drafts"] else None
    )
    return out


def complete(url: str, model: str, prompt_ids: list[int], max_tokens: int, timeout: float = 300.0) -> dict:
    """Greedy /v1/completions on token ids (no chat template on the server side: both engines see the
    same ids); returns the text and, where vLLM gives them, the output token ids."""
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        choice = json.loads(r.read())["choices"][0]
    return {
        "text": choice["text"],
        "token_ids": choice.get("token_ids"),
        "finish_reason": choice["finish_reason"],
    }
