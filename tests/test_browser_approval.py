"""Approving a promotion in the MLflow UI, as users do (issue 16 item 3), in a real headless browser.

Everything is real and started here: the Tansu broker, an MLflow tracking server, `adaflash serve`
on the tiny target following the champion, Debian's chromium driven by Selenium, and the
`adaflash registry sync` command. The challenger is registered pending approval exactly as the
pipeline's register step does in manual gate mode (`RegistryClient.register(...,
pending_approval=True)` with lineage and shadow metrics). The browser then does what the README
tells a person to do: open the registered model, find the version with the `challenger` alias,
set its tag `adaflash.approval` to `approved` (pencil, new value, Save) and add
`adaflash.approved_by`; `registry sync` must promote that version and the server must reload it.

Skips, saying how to install them, when chromium/chromedriver are absent (`make test-browser`
installs them). Set ADAFLASH_UPDATE_SCREENSHOT=1 to refresh docs/mlflow-registry-aliases.png.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from adaflash.feedback.broker import free_port
from adaflash.models.checkpoint import save_drafter
from tests.conftest import REPO, make_bundle
from tests.kafka_util import running_broker
from tests.mlflow_ui import MlflowUi, browser_binaries

pytestmark = pytest.mark.browser

APPROVER = "alice-in-the-ui"
SCREENSHOT = REPO / "docs" / "mlflow-registry-aliases.png"


@pytest.fixture(scope="module", autouse=True)
def _browser_present():
    """Skip (or, under `make test-browser`, fail) before MLflow is started for nothing."""
    browser_binaries()


def _cli_env() -> dict[str, str]:
    return {**os.environ, "ADAFLASH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.read().decode()


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _served(port: int) -> str | None:
    try:
        return json.loads(_get(f"http://127.0.0.1:{port}/health"))["drafter_version"]
    except OSError:
        return None


def _wait(cond, seconds: float, what: str, serve: tuple[subprocess.Popen, Path]) -> float:
    proc, log = serve
    t = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"{what}: adaflash serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() - t < seconds, f"{what} (waited {seconds:.0f}s)"
        time.sleep(0.1)
    return time.monotonic() - t


def test_approval_tag_set_in_the_mlflow_ui_promotes_and_the_server_reloads(tmp_path, tiny32, mlflow_server):
    from adaflash.registry.client import RegistryClient
    from adaflash.registry.versions import CHALLENGER, CHAMPION, PREVIOUS_CHAMPION

    started = time.monotonic()
    for seed in (1, 2):
        b = make_bundle(tiny32, block_size=8, seed=seed)
        save_drafter(tmp_path / f"d{seed}", b.drafter, b.length_head, b.meta)
    port = free_port()
    with running_broker(tmp_path / "broker") as broker:
        reg = RegistryClient(
            mlflow_server.tracking_uri,
            tiny32.fingerprint,
            tiny32.name,
            bootstrap_servers=broker.bootstrap_servers,
        )
        v1 = reg.register(tmp_path / "d1", lineage={"n_records": 0}, reason="bootstrap drafter")
        reg.promote(v1, who="test", reason="first champion")
        log = tmp_path / "serve.log"
        serve = subprocess.Popen(
            [sys.executable, "-m", "adaflash.cli", "serve", "--target", "tiny",
             "--drafter", str(tmp_path / "d1"), "--port", str(port),
             "--bootstrap-servers", broker.bootstrap_servers,
             "--follow-registry", mlflow_server.tracking_uri, "--spool-dir", str(tmp_path / "spool")],
            env=_cli_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        ui = None
        try:
            # A manual-gate pipeline run's register step: lineage, shadow metrics, pending approval.
            v2 = reg.register(
                tmp_path / "d2",
                lineage={"shards": ["shard-0001"], "n_records": 48, "tenants": ["tenant-a", "tenant-b"]},
                metrics={"shadow": {"chat": {"tau": 1.31}}, "champion": {"chat": {"tau": 1.12}}},
                reason="pipeline run: shadow gate said promote: beat the champion by 17%",
                pending_approval=True,
            )
            assert [p.version for p in reg.pending_approvals()] == [v2]

            ui = MlflowUi(mlflow_server.tracking_uri, tmp_path)
            with ui.step("open the registered model"):
                shown = ui.open_model(reg.model_name)
                assert shown == {v1: {CHAMPION}, v2: {CHALLENGER}}, shown
            with ui.step("open the version with the challenger alias"):
                assert ui.open_version_with_alias(reg.model_name, CHALLENGER) == v2
                assert ui.tag_value("adaflash.approval") == "pending"
            with ui.step("set adaflash.approval to approved"):
                ui.edit_tag("adaflash.approval", "approved")
            with ui.step("add adaflash.approved_by"):
                ui.add_tag("adaflash.approved_by", APPROVER)
            # What the browser did reached MLflow (before `registry sync` reads it).
            tags = reg.show(v2).tags
            assert tags["adaflash.approval"] == "approved" and tags["adaflash.approved_by"] == APPROVER

            _wait(lambda: _served(port) == v1, 60, "adaflash serve did not come up serving v1", (serve, log))
            t_sync = time.monotonic()
            sync = subprocess.run(
                [sys.executable, "-m", "adaflash.cli", "registry", "sync", "--target", "tiny",
                 "--tracking-uri", mlflow_server.tracking_uri,
                 "--bootstrap-servers", broker.bootstrap_servers],
                env=_cli_env(), capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            sync_s = time.monotonic() - t_sync
            assert sync.returncode == 0, sync.stdout + sync.stderr
            assert f"promoted v{v2}" in sync.stdout, sync.stdout
            shown = reg.show(v2)
            assert reg.champion() == v2 and CHAMPION in shown.aliases
            assert reg.resolve(PREVIOUS_CHAMPION) == v1
            assert shown.tags["adaflash.promoted_by"] == APPROVER  # the UI's approver is recorded
            assert reg.pending_approvals() == []

            _wait(
                lambda: _served(port) == v2,
                20,
                "adaflash serve did not reload the new champion",
                (serve, log),
            )
            reloaded = time.monotonic()
            metrics = _get(f"http://127.0.0.1:{port}/metrics")  # idle server: no request since
            assert f'adaflash_drafter_info{{version="{v2}"}} 1.0' in metrics
            assert 'adaflash_drafter_reloads_total{result="ok"}' in metrics
            done = _post(port, {"model": "adaflash", "prompt": "hello", "max_tokens": 8, "temperature": 0})
            assert done["adaflash"]["drafter_version"] == v2 and done["adaflash"]["method"] == "adaflash"

            with ui.step("the registry page shows the moved aliases"):
                shown = ui.open_model(reg.model_name)
                assert shown == {v1: {PREVIOUS_CHAMPION}, v2: {CHAMPION}}, shown
                shot = ui.screenshot_of_versions(tmp_path / "registry-aliases.png")
            if os.environ.get("ADAFLASH_UPDATE_SCREENSHOT"):
                shutil.copy(shot, SCREENSHOT)
            print(
                f"registry sync took {sync_s:.1f}s; served v{v2} {reloaded - t_sync:.1f}s after it began; "
                f"whole test {time.monotonic() - started:.1f}s"
            )
        finally:
            if ui is not None:
                ui.close()
            serve.terminate()
            try:
                serve.wait(15)
            except subprocess.TimeoutExpired:
                serve.kill()
            reg.close()
