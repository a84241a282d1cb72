"""Detached background processes tracked by pid files (broker, MLflow, stack services)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True while `pid` runs; reaps it when it is our child so a zombie does not count."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def pid_from_file(path: Path) -> int | None:
    """The live pid recorded in a JSON pid file (`{"pid": ...}`), or None."""
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError):
        return None
    return pid if alive(pid) else None


def terminate(pid: int, timeout: float = 10.0, group: bool = False) -> None:
    """SIGTERM (the whole process group with `group`), then SIGKILL after `timeout`."""
    kill = os.killpg if group else os.kill
    try:
        kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.05)
    try:
        kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
