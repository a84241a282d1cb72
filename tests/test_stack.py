"""`adaflash up` / `status` / `down` with the tiny target: every service really starts and stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from adaflash.feedback.broker import free_port
from adaflash.models.checkpoint import save_drafter
from tests.conftest import make_bundle


def _cli(home, *args, timeout=300):
    env = {**os.environ, "ADAFLASH_HOME": str(home), "ADAFLASH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "adaflash.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_up_serves_feeds_governance_and_down_stops_everything(tmp_path, tiny32):
    b = make_bundle(tiny32, block_size=8)
    save_drafter(tmp_path / "drafter", b.drafter, b.length_head, b.meta)
    ports = [
        "--broker-port",
        str(free_port()),
        "--registry-port",
        str(free_port()),
        "--port",
        str(free_port()),
    ]
    home = tmp_path / "home"
    try:
        up = _cli(
            home,
            "up",
            "--target",
            "tiny",
            "--drafter",
            str(tmp_path / "drafter"),
            "--min-records",
            "100000",
            *ports,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        st = _cli(home, "status", *ports)
        assert st.returncode == 0, st.stdout
        for name in ("broker", "registry", "serve", "governance", "watcher"):
            assert name in st.stdout

        # A request through the OpenAI API reaches governance as a clean record.
        body = json.dumps(
            {"model": "adaflash", "prompt": "hello there", "max_tokens": 8, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{ports[5]}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json", "X-Tenant-Id": "acme"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        deadline = time.monotonic() + 90
        while True:
            lineage = _cli(home, "lineage", "tenant", "acme", timeout=60)
            if (
                lineage.returncode == 0
                and json.loads(lineage.stdout)["clean"] + json.loads(lineage.stdout)["quarantined"] == 1
            ):
                break
            assert time.monotonic() < deadline, lineage.stdout + lineage.stderr
            time.sleep(2)
    finally:
        down = _cli(home, "down", *ports)
    assert down.returncode == 0 and "serve" in down.stdout and "broker" in down.stdout
    st = _cli(home, "status", *ports)
    assert st.returncode == 1 and st.stdout.count(" down ") == 5  # every service reports down


def test_status_of_a_stack_started_without_the_watcher_does_not_expect_one(tmp_path):
    from adaflash.ops.stack import Stack, StackConfig

    ports = {"broker_port": free_port(), "registry_port": free_port(), "serve_port": free_port()}
    started = Stack(StackConfig(home=tmp_path, target="tiny", watch=False, **ports))
    started._layout.parent.mkdir(parents=True, exist_ok=True)
    started._layout.write_text(json.dumps({"watch": False}))  # what `up --no-watch` records
    seen = Stack(StackConfig(home=tmp_path, target="tiny", **ports))  # what `status` rebuilds from ports
    names = [r["service"] for r in seen.status()]
    assert "watcher" not in names and {"broker", "registry", "serve", "governance"} <= set(names)
    started._layout.write_text(json.dumps({"watch": True}))
    assert "watcher" in [r["service"] for r in seen.status()]
