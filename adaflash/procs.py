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


def _stat(path: Path) -> list[str] | None:
    """Fields 3 onward of a `/proc/<pid>/stat`, or None once the process is gone. The command
    name (field 2) may hold spaces and parentheses: split after the last ')'."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) `pid` has used so far; None without /proc or once it is gone."""
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float | None:
    """CPU seconds used so far by the processes of group `pgid`, with the children they have
    reaped (a compiler run, a forked worker); None where there is no /proc to read."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    ticks = 0
    for stat in proc.glob("[0-9]*/stat"):
        fields = _stat(stat)
        if fields is not None and int(fields[2]) == pgid:  # fields 5 (pgrp), 14-17 (utime..cstime)
            ticks += sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")
