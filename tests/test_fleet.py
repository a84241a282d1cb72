"""Fleet controller: champion changes reach a running engine (for real) and SGLang (request level)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from adaflash.models.checkpoint import save_drafter
from adaflash.serving.champion_follower import ChampionFollower
from adaflash.serving.fleet import Backend, FleetConfig, FleetController
from tests.conftest import make_bundle
from tests.kafka_util import running_broker
from tests.test_server import TOKEN, serving


class KubeApi(BaseHTTPRequestHandler):
    """No cluster here: a stand-in for the Kubernetes API records the PATCH the controller sends."""

    calls: list = []

    def do_PATCH(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        KubeApi.calls.append((self.path, self.headers["Content-Type"], self.headers["Authorization"], body))
        data = b'{"kind": "Deployment"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_promotion_and_rollback_reach_engine_and_sglang(tmp_path, tiny32, mlflow_server, monkeypatch):
    from adaflash.registry.client import RegistryClient

    for seed in (1, 2):
        b = make_bundle(tiny32, block_size=8, seed=seed)
        save_drafter(tmp_path / f"d{seed}", b.drafter, b.length_head, b.meta)
    kube = HTTPServer(("127.0.0.1", 0), KubeApi)
    threading.Thread(target=kube.serve_forever, daemon=True).start()
    (tmp_path / "token").write_text("sa-token\n")
    monkeypatch.setenv("FLEET_ADMIN_TOKEN", TOKEN)
    with (
        running_broker(tmp_path / "broker") as broker,
        serving(tiny32, make_bundle(tiny32, block_size=8)) as (
            engine,
            srv,
        ),
    ):
        cfg = FleetConfig(
            tracking_uri=mlflow_server.tracking_uri,
            bootstrap_servers=broker.bootstrap_servers,
            target="tiny",
            drafter_dir=str(tmp_path / "shared-drafters"),
            backends=[
                Backend("adaflash-engine", url=srv.url, token_env="FLEET_ADMIN_TOKEN"),
                Backend(
                    "sglang-deployment",
                    namespace="adaflash",
                    deployment="sglang",
                    api_server=f"http://127.0.0.1:{kube.server_port}",
                    token_file=str(tmp_path / "token"),
                ),
            ],  # fmt: skip
        )
        controller = FleetController(cfg, tiny32.fingerprint)
        follower = ChampionFollower(
            None,
            broker.bootstrap_servers,
            mlflow_server.tracking_uri,
            tiny32.fingerprint,
            apply=controller.apply,
        )
        follower.reconcile_s = 0.3
        follower.start()
        reg = RegistryClient(
            mlflow_server.tracking_uri, tiny32.fingerprint, bootstrap_servers=broker.bootstrap_servers
        )
        try:
            v1 = reg.register(tmp_path / "d1", lineage={"n_records": 0})
            reg.promote(v1, who="ops", reason="first")
            v2 = reg.register(tmp_path / "d2", lineage={"n_records": 0})
            reg.promote(v2, who="ops", reason="better")
            reg.rollback(who="ops", reason="regression")
            # Events are hints to re-read the registry, so moves in quick succession may reach the
            # fleet as their end state only (v1), never as a stale one after it.
            deadline = time.monotonic() + 30
            time.sleep(1.0)  # reconciles after the rollback
            while not follower.status.applied or follower.status.applied[-1] != v1:
                assert time.monotonic() < deadline, (follower.status, controller.applied)
                time.sleep(0.1)
            deadline = time.monotonic() + 10
            while engine.drafter_version != v1:  # staged drafters go live at the next step
                assert time.monotonic() < deadline
                time.sleep(0.05)
            # The controller dies between an alias move and its reload: nobody consumes the
            # event. Restarted, it reads events from the end (that one is gone) and its first
            # reconcile with the registry's champion applies it.
            follower.stop()
            first = follower
            reg.promote(v2, who="ops", reason="while the fleet controller was down")
            controller = FleetController(cfg, tiny32.fingerprint)
            follower = ChampionFollower(
                None, broker.bootstrap_servers, mlflow_server.tracking_uri, tiny32.fingerprint,
                apply=controller.apply,
            )  # fmt: skip
            follower.reconcile_s = 0.5
            follower.start()
            deadline = time.monotonic() + 20
            while engine.drafter_version != v2:
                assert time.monotonic() < deadline, (follower.status, controller.applied)
                time.sleep(0.05)
        finally:
            follower.stop()
            reg.close()
            kube.shutdown()
    applied = first.status.applied
    assert applied[-1] == v1 and set(applied) <= {v1, v2} and not first.status.failed
    assert all(a != b for a, b in zip(applied, applied[1:], strict=False))  # each change live once
    assert follower.status.applied == [v2] and engine.reloads == len(applied) + 1
    patches = KubeApi.calls
    assert [
        c[3]["spec"]["template"]["metadata"]["annotations"]["adaflash.io/drafter-version"] for c in patches
    ] == [*applied, v2]
    path, ctype, auth, _ = patches[0]
    assert path == "/apis/apps/v1/namespaces/adaflash/deployments/sglang"
    assert ctype == "application/strategic-merge-patch+json" and auth == "Bearer sa-token"


def test_fleet_config_loads_the_manifest_configmap(tmp_path):
    import yaml

    from tests.conftest import REPO

    docs = list(yaml.safe_load_all((REPO / "manifests" / "base" / "fleet-controller.yaml").read_text()))
    cm = next(d for d in docs if d and d["kind"] == "ConfigMap")
    path = tmp_path / "fleet.yaml"
    path.write_text(cm["data"]["fleet.yaml"])
    cfg = FleetConfig.load(path)
    assert [b.kind for b in cfg.backends] == ["sglang-deployment"]
    assert (
        cfg.backends[0].deployment == "sglang" and cfg.backends[0].annotation == "adaflash.io/drafter-version"
    )
