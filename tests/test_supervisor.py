"""The stack's supervisor on real (small) processes: restarts with backoff what dies, leaves alone
what exits cleanly, gives up after too many restarts and says so, retries on request, and takes a
dead service's leftover children with it. The whole stack under it: tests/test_stack.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from adaflash.ops.supervisor import RestartPolicy, Supervisor, Unit, describe_exit, read_state
from adaflash.procs import alive


def _proc(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], start_new_session=True)


def _unit(name: str, script: str, spawned: list, ready=lambda: True) -> Unit:
    def spawn():
        p = _proc(script)
        spawned.append(p.pid)
        return p

    return Unit(name, spawn, ready, lambda: None)


def _kill_groups(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_policy_backs_off_exponentially_up_to_the_cap():
    p = RestartPolicy(base_s=1.0, cap_s=30.0)
    assert [p.delay(r) for r in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert describe_exit(-9) == "SIGKILL" and describe_exit(70) == "exit 70"


def test_restarts_gives_up_retries_and_cleans_up(tmp_path: Path):
    spawned: list[int] = []
    grandchild = tmp_path / "grandchild.pid"
    calls = []

    def flaky_spawn():  # dies once, then cannot start once (its port still held), then runs
        calls.append(1)
        if len(calls) == 2:
            raise OSError("port 5000 is already in use")
        p = _proc(
            "import sys, time; time.sleep(1.5); sys.exit(1)"
            if len(calls) == 1
            else "import time; time.sleep(120)"
        )
        spawned.append(p.pid)
        return p

    units = [
        Unit("flaky", flaky_spawn, lambda: True, lambda: None),
        _unit("steady", "import time; time.sleep(120)", spawned),
        # Forks a child in its own process group (as `mlflow server` forks its uvicorn worker).
        _unit(
            "parent",
            f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(120)']); open({str(grandchild)!r}, 'w').write(str(c.pid)); "
            "time.sleep(120)",
            spawned,
        ),
        _unit("crashy", "import sys, time; time.sleep(0.4); sys.exit(3)", spawned),
        _unit("clean", "import time; time.sleep(0.4)", spawned),
        Unit("broken", lambda: subprocess.Popen(["/nonexistent/binary"]), lambda: True, lambda: None),
    ]
    state_file = tmp_path / "supervisor.json"
    policy = RestartPolicy(base_s=0.1, cap_s=0.2, max_restarts=2, window_s=60)
    sup = Supervisor(units, policy, state_file).start()
    try:

        def svc(name):
            return read_state(state_file).get("services", {}).get(name, {})

        # A retry asked for while everything runs (an `up` on a healthy stack) changes nothing
        # about the deaths that come later: they are still backed off, counted, given up on, and
        # a restart that fails is retried, not taken for a first start that failed.
        _wait(lambda: svc("flaky").get("state") == "running")
        _wait(lambda: svc("steady").get("state") == "running")
        steady = svc("steady")["pid"]
        sup.retry()
        _wait(lambda: svc("flaky").get("restarts") == 2 and svc("flaky").get("state") == "running")
        assert svc("flaky")["last_exit"] == "restart failed: port 5000 is already in use"
        _wait(lambda: svc("crashy").get("state") == "gave up")
        crashy = svc("crashy")
        assert crashy["restarts"] == 2 and crashy["last_exit"] == "exit 3"
        assert "2 restarts within 60s" in crashy["note"]
        _wait(lambda: svc("clean").get("state") == "exited")
        assert svc("clean")["restarts"] == 0 and svc("clean")["last_exit"] == "exit 0"
        assert svc("broken")["state"] == "gave up" and "failed to start" in svc("broken")["note"]

        # kill -9: restarted (after 0.1 s), the exit recorded, its forked child killed with it.
        _wait(lambda: grandchild.exists() and grandchild.read_text())
        first_child = int(grandchild.read_text())
        grandchild.unlink()
        old = svc("parent")["pid"]
        os.kill(old, signal.SIGKILL)
        _wait(lambda: svc("parent").get("restarts") == 1 and svc("parent").get("state") == "running")
        assert svc("parent")["last_exit"] == "SIGKILL" and svc("parent")["pid"] != old
        _wait(lambda: not alive(first_child))  # not left holding a port

        # A retry (what `adaflash up` asks for) starts what gave up or exited, with a fresh history.
        n = len(spawned)
        sup.retry()
        _wait(lambda: svc("clean").get("state") in ("running", "exited") and len(spawned) >= n + 2)
        assert json.loads(state_file.read_text())["generation"] == 2
        assert svc("steady")["restarts"] == 0 and svc("steady")["pid"] == steady
    finally:
        sup.stop()
        _kill_groups(spawned)
    # Stopped: nothing is started any more, whatever dies.
    n = len(spawned)
    time.sleep(1.0)
    assert len(spawned) == n


def test_a_start_is_bounded_by_its_progress_not_by_the_clock(tmp_path: Path):
    """A service still working after ready_timeout_s (a serve loading and timing its model on a
    busy machine) is waited for; one that makes no progress fails after it; a start that works
    forever without getting ready fails at the cap."""
    spawned: list[int] = []
    ready = tmp_path / "busy.ready"
    busy = (
        "import time, pathlib\nt = time.process_time()\n"
        "while time.process_time() - t < 3.0:\n    pass\n"
        f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(120)"
    )
    units = [
        _unit("busy", busy, spawned, ready.exists),  # 3 CPU seconds of start-up: past the 1 s timeout
        _unit("stuck", "import time; time.sleep(120)", spawned, lambda: False),  # blocked, never ready
        _unit("spinning", "while True:\n    pass", spawned, lambda: False),  # works, never ready: the cap
    ]
    policy = RestartPolicy(
        base_s=0.1, cap_s=0.2, max_restarts=0, window_s=60, ready_timeout_s=1.0, ready_cap_s=8.0
    )
    t0 = time.monotonic()
    # One supervisor each: a supervisor starts a service once those before it are ready.
    sups = [Supervisor([u], policy, tmp_path / f"{u.name}.json").start() for u in units]
    try:

        def svc(name):
            return read_state(tmp_path / f"{name}.json").get("services", {}).get(name, {})

        _wait(lambda: svc("stuck").get("state") == "gave up")
        assert "no progress for 1s" in svc("stuck")["note"]
        assert time.monotonic() - t0 < 6.0  # failed at its timeout, not at the cap
        _wait(lambda: svc("busy").get("state") == "running", timeout=30.0)
        assert ready.exists()
        _wait(lambda: svc("spinning").get("state") == "gave up", timeout=30.0)
        assert "not ready within 8s" in svc("spinning")["note"]
    finally:
        for sup in sups:
            sup.stop()
        _kill_groups(spawned)
