"""Fleet controller: make the registry's champion live on every backend of the serving fleet.

It follows the registry's champion through a `ChampionFollower` (events are hints to re-read its
own configured registry; only a champion with a promotion record is made live) and, per backend
in its config:

  adaflash-engine     download the version into the shared drafter directory and call the
                      engine's `POST /admin/drafter/reload` (validated off the step loop, swapped
                      between steps; a bad checkpoint is refused and the old one keeps serving)
  sglang-deployment   patch the SGLang Deployment's pod-template annotation with the version: a
                      rolling restart whose init container exports the new champion. (SGLang's
                      DFlash worker routes weight updates to the target model, not the draft
                      model, so an in-place update is not used.)
  vllm-process        a local vLLM replica set behind a stable front port (`vllm_fleet.py`):
                      export the version for vLLM, start a second server with it, switch the
                      front, stop the old one (on CPU there is no runtime draft-weight update:
                      vLLM moves draft weights over NCCL only)

Config (YAML), as in manifests/base/fleet-controller.yaml:
    tracking_uri, bootstrap_servers, target, drafter_dir (engine backends),
    backends: [{kind: adaflash-engine, url, token_env}, {kind: sglang-deployment, namespace,
               deployment, annotation, api_server?, token_file?, ca_file?},
               {kind: vllm-process, port, model_path?, venv?, method?}]
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.feedback.events import DrafterEvent

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass
class Backend:
    kind: str
    url: str | None = None  # adaflash-engine
    token_env: str = "ADAFLASH_ADMIN_TOKEN"
    namespace: str = "adaflash"  # sglang-deployment
    deployment: str = "sglang"
    annotation: str = "adaflash.io/drafter-version"
    api_server: str = "https://kubernetes.default.svc"
    token_file: str = str(SA_DIR / "token")
    ca_file: str | None = str(SA_DIR / "ca.crt")
    port: int = 8000  # vllm-process: the stable front port (put the gateway in front of it)
    model_path: str | None = None  # vllm-process: the target's HF folder (default: the target's)
    venv: str | None = None  # vllm-process: vLLM's virtualenv (default .venv-vllm)
    method: str = "dflash"  # vllm-process: dflash with the champion; ngram | suffix | ar without it
    args: list[str] = field(default_factory=list)  # vllm-process: more vLLM server arguments


KINDS = ("adaflash-engine", "sglang-deployment", "vllm-process")


@dataclass
class FleetConfig:
    tracking_uri: str
    bootstrap_servers: str
    target: str
    drafter_dir: str = "/drafters"
    backends: list[Backend] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> FleetConfig:
        import yaml

        try:
            raw = yaml.safe_load(path.read_text())
            backends = [Backend(**b) for b in raw.pop("backends", [])]
            cfg = cls(**raw, backends=backends)
        except (OSError, yaml.YAMLError, TypeError) as e:
            raise AdaFlashError(f"bad fleet config {path}: {e}") from None
        unknown = [b.kind for b in backends if b.kind not in KINDS]
        if unknown:
            raise AdaFlashError(f"unknown backend kind(s) {unknown}: use {', '.join(KINDS)}")
        return cfg


def _request(url: str, method: str, body: dict, headers: dict, context: ssl.SSLContext | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=60, context=context) as r:
        return json.loads(r.read() or b"{}")


class FleetController:
    def __init__(self, cfg: FleetConfig, fingerprint: str) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.applied: list[tuple[str, str, str]] = []  # (backend, version, outcome)
        self.vllm: dict[int, object] = {}  # front port -> VllmReplicas

    def apply(self, event: DrafterEvent) -> str:
        """Make `event.version` live everywhere; raises if any backend failed (after trying all)."""
        errors = []
        for b in self.cfg.backends:
            try:
                {"adaflash-engine": self._engine, "vllm-process": self._vllm}.get(b.kind, self._sglang)(
                    b, event
                )
                self.applied.append((_name(b), event.version, "ok"))
            except Exception as e:  # noqa: BLE001 - one backend's failure must not skip the others
                self.applied.append((_name(b), event.version, f"failed: {e}"))
                errors.append(f"{b.kind}: {e}")
        if errors:
            raise AdaFlashError("; ".join(errors))
        return event.version

    def _engine(self, b: Backend, event: DrafterEvent) -> None:
        from adaflash.registry.client import RegistryClient

        dst = Path(self.cfg.drafter_dir) / f"v{event.version}"
        # The configured registry only: an event's tracking_uri is never dialled (a forged event
        # could name any server).
        with RegistryClient(self.cfg.tracking_uri, self.fingerprint) as reg:
            path = reg.download(event.version, dst)
        token = os.environ.get(b.token_env, "")
        _request(
            f"{b.url.rstrip('/')}/admin/drafter/reload",
            "POST",
            {"path": str(path), "version": event.version},
            {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )

    def _vllm(self, b: Backend, event: DrafterEvent) -> None:
        from adaflash.registry.client import RegistryClient
        from adaflash.serving.export import target_model_path
        from adaflash.serving.vllm_engine import vllm_python
        from adaflash.serving.vllm_fleet import Front, VllmReplicas

        replicas = self.vllm.get(b.port)
        if replicas is None:
            replicas = VllmReplicas(b.model_path or target_model_path(self.cfg.target),
                                    Path(self.cfg.drafter_dir), str(vllm_python(b.venv)),
                                    Front("0.0.0.0", b.port), method=b.method, args=list(b.args))  # fmt: skip
            self.vllm[b.port] = replicas
        with RegistryClient(self.cfg.tracking_uri, self.fingerprint) as reg:
            path = reg.download(event.version, Path(self.cfg.drafter_dir) / f"v{event.version}")
        sw = replicas.apply(event.version, path)
        log.info("vllm :%d now serves v%s (%s): %s", b.port, event.version, sw.method, sw)

    def close(self) -> None:
        """Stop the vLLM servers this controller started."""
        for replicas in self.vllm.values():
            replicas.stop()

    def _sglang(self, b: Backend, event: DrafterEvent) -> None:
        token = Path(b.token_file).read_text().strip()
        context = None
        if b.api_server.startswith("https"):
            context = ssl.create_default_context(
                cafile=b.ca_file if b.ca_file and Path(b.ca_file).exists() else None
            )
        patch = {"spec": {"template": {"metadata": {"annotations": {b.annotation: event.version}}}}}
        _request(
            f"{b.api_server.rstrip('/')}/apis/apps/v1/namespaces/{b.namespace}/deployments/{b.deployment}",
            "PATCH",
            patch,
            {"Content-Type": "application/strategic-merge-patch+json", "Authorization": f"Bearer {token}"},
            context,
        )


def _name(b: Backend) -> str:
    if b.kind == "vllm-process":
        return f"vllm:{b.port}"
    return b.url or f"{b.namespace}/{b.deployment}"


def serve_health(port: int, controller: FleetController) -> HTTPServer:
    """`GET /healthz` for the Deployment's probes; the body lists what was applied."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "applied": controller.applied[-20:]}).encode()
            self.send_response(200 if self.path == "/healthz" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("0.0.0.0", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True, name="fleet-health").start()
    return server
