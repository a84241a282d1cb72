"""`adaflash up` / `status` / `down` with the tiny target: every service really starts, is
restarted by the supervisor when it dies, and stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from adaflash.feedback.broker import free_port, port_open
from adaflash.models.checkpoint import save_drafter
from adaflash.procs import alive, pid_from_file
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


def _status(home, ports) -> tuple[int, dict[str, dict]]:
    st = _cli(home, "status", "--json", *ports, timeout=60)
    return st.returncode, {r["service"]: r for r in json.loads(st.stdout)}


def _until_status(home, ports, pred, timeout: float, what: str) -> tuple[int, dict[str, dict]]:
    """Poll `status --json` until pred(rc, rows)."""
    deadline = time.monotonic() + timeout
    while not pred(*(got := _status(home, ports))):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {got}"
        time.sleep(0.5)
    return got


def _complete(port: str, tenant: str) -> int:
    body = json.dumps(
        {"model": "adaflash", "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "X-Tenant-Id": tenant},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


def test_up_serves_feeds_governance_restarts_what_dies_and_down_stops_everything(tmp_path, tiny32):
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
    pids: set[int] = set()
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
            "--max-restarts",
            "1",  # the watcher's second death below makes it give up
            *ports,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        st = _cli(home, "status", *ports)
        assert st.returncode == 0, st.stdout
        for name in ("broker", "registry", "serve", "governance", "watcher", "supervisor"):
            assert name in st.stdout

        # A request through the OpenAI API reaches governance as a clean record.
        assert _complete(ports[5], "acme") == 200
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

        # kill -9 the server: the supervisor restarts it, it serves again, status says so.
        _, rows = _status(home, ports)
        pids |= {r["pid"] for r in rows.values()}
        os.kill(rows["serve"]["pid"], signal.SIGKILL)
        _, rows = _until_status(
            home, ports, lambda rc, r: rc == 0 and r["serve"]["restarts"] == 1, 120, "serve's restart"
        )
        assert rows["serve"]["last_exit"] == "SIGKILL" and rows["serve"]["pid"] not in pids
        assert _complete(ports[5], "after-restart") == 200
        pids.add(rows["serve"]["pid"])

        # A non-zero exit is restarted too; past --max-restarts the supervisor gives up, says so,
        # and `up` starts the service again.
        os.kill(rows["watcher"]["pid"], signal.SIGINT)  # the CLI exits 130
        _, rows = _until_status(
            home,
            ports,
            lambda rc, r: r["watcher"]["restarts"] == 1 and r["watcher"]["running"],
            60,
            "a restart",
        )
        assert rows["watcher"]["last_exit"] == "exit 130"
        pids.add(rows["watcher"]["pid"])
        os.kill(rows["watcher"]["pid"], signal.SIGKILL)
        rc, rows = _until_status(
            home, ports, lambda rc, r: r["watcher"]["state"] == "gave up", 30, "the supervisor to give up"
        )
        assert (
            rc == 1 and not rows["watcher"]["running"] and "1 restart within 300s" in rows["watcher"]["note"]
        )
        assert "gave up" in _cli(home, "status", *ports).stdout
        again = _cli(home, "up", "--target", "tiny", "--drafter", str(tmp_path / "drafter"), *ports)
        assert again.returncode == 0, again.stdout + again.stderr
        rc, rows = _status(home, ports)
        assert rc == 0 and rows["watcher"]["running"]
        pids |= {r["pid"] for r in rows.values()}
    finally:
        down = _cli(home, "down", *ports)
    assert down.returncode == 0 and "supervisor" in down.stdout and "broker" in down.stdout
    assert down.stdout.index("supervisor") < down.stdout.index("serve")  # first: nothing restarts
    time.sleep(3)  # long enough for a supervisor's backoff: nothing comes back
    assert not [p for p in pids if alive(p)], "a process outlived `adaflash down`"
    assert (
        not list((home / "stack").glob("*.json")) and pid_from_file(home / "broker" / "broker.json") is None
    )
    assert not any(port_open("127.0.0.1", int(p)) for p in ports[1::2])
    rc, rows = _status(home, ports)
    assert rc == 1 and not any(r["running"] for r in rows.values()) and len(rows) == 6


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
