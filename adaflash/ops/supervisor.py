"""The stack's supervisor: a service of `adaflash up` that dies is restarted, with backoff.

Where it runs: one small detached process per stack, `adaflash up` starts it (pid and state in
`$ADAFLASH_HOME/stack/supervisor.json`, log `stack/supervisor.log`; what to run it reads from the
layout file `$ADAFLASH_HOME/stack-layout.json` that `up` writes). It starts every service itself,
in dependency order, so it is their parent: it learns each exit code or signal from the kernel,
not by polling a pid file. `adaflash down` stops the supervisor first and only then the services,
so nothing restarts what `down` stopped; a supervisor that is itself killed leaves the services
running, and the next `up` starts a new one that adopts them (it cannot know how an adopted
process exits, only that it did).

Policy (`RestartPolicy`), systemd's `Restart=on-failure` with exponential backoff:
- a non-zero exit or a death by signal is restarted after base·2^r seconds (capped), r = restarts
  of that service within the last `window_s`;
- a clean exit (0: someone stopped it on purpose, e.g. a broker that got SIGTERM) is not
  restarted; neither is a service whose first start failed (a port in use, a bad drafter: a
  retry would fail the same way and `up` reports it at once);
- after `max_restarts` restarts within `window_s` it gives up on that service and says so.
`adaflash up` run again (SIGHUP to a running supervisor) retries every service that is not
running, forgetting its restart history. `adaflash status` shows each service's restarts, last
exit and next restart time (or "gave up").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from adaflash.procs import alive, group_cpu_seconds

PROGRESS_EVERY_S = 2.0  # how often a starting service's CPU time is read
MIN_PROGRESS_CPU_SHARE = 0.025  # CPU seconds per second that count as working (blocked: ~0)

log = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    base_s: float = 1.0  # first restart delay
    cap_s: float = 30.0  # longest delay between restarts
    max_restarts: int = 5  # within window_s; one more death and the supervisor gives up
    window_s: float = 300.0
    # A (re)starting service fails once it has made no progress (used no CPU, its process group
    # counted) for ready_timeout_s, or has not passed its readiness probe within ready_cap_s. A
    # start that is still working (loading weights, compiling kernels, timing its cost model) on
    # a machine busy with something else is slow, not failed.
    ready_timeout_s: float = 180.0
    ready_cap_s: float = 1800.0

    def delay(self, recent: int) -> float:
        """Seconds to wait before the restart that follows `recent` restarts in the window."""
        return min(self.base_s * 2**recent, self.cap_s)


@dataclass
class Unit:
    """One supervised service: how to start it and how to tell it is ready, with no pid file in
    between (reading one reaps a dead child, and its exit status with it)."""

    name: str
    spawn: Callable[[], subprocess.Popen]  # start it (non-blocking) and write its pid file
    ready: Callable[[], bool]  # its port answers / its health check passes
    adopt: Callable[[], int | None]  # the pid of one already running that this supervisor did not start
    after_ready: Callable[[], None] = lambda: None  # the broker: create the topics (memory-only)


@dataclass
class ServiceState:
    """What `adaflash status` shows of one service (the state file holds one per service)."""

    state: str = "waiting"  # waiting | starting | running | backoff | exited | gave up
    pid: int | None = None
    restarts: int = 0  # since this supervisor started
    last_exit: str | None = None  # "exit 70", "SIGKILL", "exited (adopted: status unknown)"
    last_exit_at: float | None = None  # wall clock
    next_restart_at: float | None = None  # wall clock, while in backoff
    note: str | None = None  # why it gave up / failed to start


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


def _wait_exit(pid: int) -> None:
    """Block until child `pid` exits, leaving it a zombie: its pid (and so its process group id)
    cannot be reused until it is reaped, so the group can still be cleaned up safely."""
    while True:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            return
        except ChildProcessError:
            return
        except InterruptedError:
            continue


class _Progress:
    """Whether a starting service is still working: its process group's CPU time grew within
    the last `timeout` seconds (looked at every PROGRESS_EVERY_S at most). Without /proc, a fixed
    deadline."""

    def __init__(self, pgid: int, timeout: float) -> None:
        self.pgid, self.timeout = pgid, timeout
        self.every = min(PROGRESS_EVERY_S, timeout / 2)
        self.cpu = group_cpu_seconds(pgid)
        now = time.monotonic()
        self.stalls_at, self.next_look = now + timeout, now + self.every

    def working(self, now: float) -> bool:
        if self.cpu is not None and now >= self.next_look:
            used = group_cpu_seconds(self.pgid)
            if used > self.cpu + MIN_PROGRESS_CPU_SHARE * self.every:
                self.stalls_at = now + self.timeout
            self.cpu, self.next_look = used, now + self.every
        return now <= self.stalls_at


def _exited(pid: int) -> bool:
    """True once child `pid` has exited, without reaping it (see `_wait_exit`)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _reap(proc: subprocess.Popen, timeout: float = 10.0) -> str:
    """A dead service's leftovers (MLflow's uvicorn worker would keep the port) go with it: each
    service leads its own process group, killed while the zombie still holds the group's id.
    Then reap it and wait for the rest of the group to be gone; returns how it exited."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    how = describe_exit(proc.wait())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.05)
    return how


class Supervisor:
    def __init__(self, units: list[Unit], policy: RestartPolicy, state_file: Path) -> None:
        self.units = units
        self.policy = policy
        self.state_file = state_file
        self.states = {u.name: ServiceState() for u in units}
        self.generation = 0  # bumped by each retry request (SIGHUP from `adaflash up`)
        self._ready = {u.name: threading.Event() for u in units}
        self._stop = threading.Event()
        # Guards the states and the generation, wakes waits on a retry or a stop (an RLock: the
        # SIGHUP handler runs on the main thread, which may hold it).
        self._cond = threading.Condition()
        self._spawn_lock = threading.Lock()  # held from "not stopping?" to "pid file written"

    # -- the process --------------------------------------------------------------------------
    def run(self) -> None:
        """Supervise until SIGTERM/SIGINT; then exit without stopping anything (`down` does)."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        signal.signal(signal.SIGHUP, lambda *_: self.retry())
        self.start()
        while not self._stop.wait(0.5):
            pass
        self.stop()
        log.info("stopping; the services keep running until `adaflash down` stops them")

    def start(self) -> Supervisor:
        """One thread per service: each starts its service once those before it are ready."""
        self._write()
        log.info("supervising %s (%s)", ", ".join(u.name for u in self.units), self.policy)
        for i, u in enumerate(self.units):
            deps = self.units[:i]
            threading.Thread(target=self._supervise, args=(u, deps), name=u.name, daemon=True).start()
        return self

    def stop(self) -> None:
        """Start nothing more; returns once no start is half done (process up, pid file not yet
        written), so whoever stops the services next finds every one of them."""
        self._stop.set()
        with self._spawn_lock:
            with self._cond:
                for s in self.states.values():
                    s.next_restart_at = None
                self._write()
                self._cond.notify_all()

    def retry(self) -> None:
        """Start every service that is not running now, forgetting its restart history."""
        with self._cond:
            self.generation += 1
            for s in self.states.values():
                if s.state in ("gave up", "exited", "backoff"):
                    s.state, s.note, s.next_restart_at = "waiting", "retry requested", None
            self._write()
            self._cond.notify_all()

    # -- one service --------------------------------------------------------------------------
    def _supervise(self, u: Unit, deps: list[Unit]) -> None:
        for d in deps:  # dependency order: the broker and MLflow answer before serve starts
            if not self._ready[d.name].is_set():
                self._set(u, note=f"waiting for {d.name}")
            while not self._ready[d.name].wait(0.5):
                if self._stop.is_set():
                    return
        history: deque[float] = deque()  # monotonic times of this service's recent restarts
        fresh = True  # a first start (or one `up` asked for): its failure is reported, not retried
        adopted = u.adopt()
        while not self._stop.is_set():
            gen = self.generation  # a retry asked for from here on is answered by this start
            if adopted is not None:
                self._set(u, state="running", pid=adopted, note="adopted: started before this supervisor")
                self._ready[u.name].set()
                how = self._watch_adopted(adopted)
                adopted = None
            else:
                proc, err = self._start(u)
                if err is not None and fresh:
                    if self._stop.is_set():
                        return
                    log.error("%s failed to start: %s", u.name, err)
                    self._set(u, state="gave up", pid=None, note=f"failed to start: {err}")
                    self._wait_retry(gen)
                    continue
                how = f"restart failed: {err}" if err is not None else self._wait_child(proc)
            if self._stop.is_set() or how is None:
                return  # `adaflash down` is stopping the stack: this exit is its doing
            gen = self.generation  # from here on, a retry is about this exit
            fresh = False
            self._set(u, pid=None, last_exit=how, last_exit_at=time.time())
            now = time.monotonic()
            while history and now - history[0] > self.policy.window_s:
                history.popleft()
            if how == "exit 0" or len(history) >= self.policy.max_restarts:
                if how == "exit 0":
                    log.info("%s exited cleanly: not restarted", u.name)
                    self._set(u, state="exited", note="clean exit: not restarted (`adaflash up` starts it)")
                else:
                    n, window = len(history), self.policy.window_s
                    note = f"{n} restart{'s' if n != 1 else ''} within {window:.0f}s; last: {how}"
                    log.error("%s died (%s): giving up after %s", u.name, how, note)
                    self._set(u, state="gave up", note=note)
                self._wait_retry(gen)
                history.clear()
                fresh = True
                continue
            delay = self.policy.delay(len(history))
            log.warning("%s died (%s): restart %d in %.1fs", u.name, how, len(history) + 1, delay)
            self._set(u, state="backoff", next_restart_at=time.time() + delay, note=None)
            if not self._sleep(delay, gen):
                return
            if self.generation != gen:  # `up` asked for a retry meanwhile: its start, a fresh history
                history.clear()
                fresh = True
                continue
            history.append(time.monotonic())
            with self._cond:
                self.states[u.name].restarts += 1

    def _start(self, u: Unit) -> tuple[subprocess.Popen | None, str | None]:
        """Spawn `u` and wait until it is ready: (process, None), or (process or None, why not)."""
        self._set(u, state="starting", next_restart_at=None)
        with self._spawn_lock:
            if self._stop.is_set():
                return None, "stopping"
            try:
                proc = u.spawn()
            except Exception as e:  # noqa: BLE001 - a port in use, a missing binary: report it
                return None, str(e)
        self._set(u, pid=proc.pid)
        start = time.monotonic()
        progress = _Progress(proc.pid, self.policy.ready_timeout_s)
        while not self._stop.is_set():
            if _exited(proc.pid):
                return proc, f"{_reap(proc)} during start-up"
            try:
                if u.ready():
                    u.after_ready()
                    self._set(u, state="running", note=None)
                    self._ready[u.name].set()
                    return proc, None
            except Exception as e:  # noqa: BLE001 - e.g. topics not creatable yet: probe again
                log.debug("%s not ready yet: %s", u.name, e)
            now = time.monotonic()
            if not progress.working(now):
                _reap(proc)
                return proc, f"not ready, and no progress for {self.policy.ready_timeout_s:.0f}s"
            if now > start + self.policy.ready_cap_s:
                _reap(proc)
                return proc, f"not ready within {self.policy.ready_cap_s:.0f}s"
            time.sleep(0.2)
        return proc, None

    def _wait_child(self, proc: subprocess.Popen) -> str | None:
        _wait_exit(proc.pid)
        how = _reap(proc)
        return None if self._stop.is_set() else how

    def _watch_adopted(self, pid: int) -> str | None:
        while alive(pid):
            if self._stop.wait(0.5):
                return None
        return "exited (adopted: status unknown)"

    def _wait_retry(self, gen: int) -> None:
        """Wait for `adaflash up` to ask for a retry (SIGHUP), or for the stop."""
        with self._cond:
            while self.generation == gen and not self._stop.is_set():
                self._cond.wait(1.0)

    def _sleep(self, seconds: float, gen: int) -> bool:
        """The backoff; a retry request cuts it short. False when the supervisor is stopping."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._stop.is_set() and self.generation == gen:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return not self._stop.is_set()

    # -- state ----------------------------------------------------------------------------------
    def _set(self, u: Unit, **changes) -> None:
        with self._cond:
            s = self.states[u.name]
            for k, v in changes.items():
                setattr(s, k, v)
            self._write()

    def _write(self) -> None:
        """The pid file `down` and `status` read, with each service's state (atomic replace)."""
        body = {
            "pid": os.getpid(),
            "generation": self.generation,
            "policy": asdict(self.policy),
            "services": {name: asdict(s) for name, s in self.states.items()},
        }
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.state_file)


def read_state(state_file: Path) -> dict:
    """The supervisor's last written state, or {} (none yet, or being replaced)."""
    try:
        return json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
