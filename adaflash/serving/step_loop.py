"""The engine's step-loop thread: runs `step()` until stopped, and contains failures — its own
and those of the callbacks it runs (request sinks, finish observers).

A step that raises without being pinned on one request fails the requests it was running (their
state is unknown) and the loop goes on with the others; after `MAX_STEP_FAILURES` in a row the
loop stops for good, every waiting request is failed and `failure` says why (the server's /health
reports it and `serve` exits so that a supervisor restarts the process).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from adaflash.errors import AdaFlashError
from adaflash.serving.request import Request

log = logging.getLogger(__name__)

# Consecutive failed steps (not pinned on one request) after which the step loop gives up: the
# process should then exit so that a supervisor restarts it.
MAX_STEP_FAILURES = 3


class EngineFailed(AdaFlashError):
    """The step loop has stopped (repeated failures): nothing can be served until a restart."""


class StepLoop:
    """Mixed into `Engine`, which provides `step` and `scheduler` and calls `_init_loop`."""

    def _init_loop(self) -> None:
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._cancel: set[str] = set()
        self._cancel_lock = threading.Lock()
        self.observers: list[Callable[[Request], None]] = []  # called once per finished request

    def cancel(self, request_id: str) -> None:
        """Cancel a waiting or running request (any thread); its slot is freed before the next step."""
        with self._cancel_lock:
            self._cancel.add(request_id)
        self._wake.set()

    def _reap_cancelled(self) -> None:
        with self._cancel_lock:
            ids, self._cancel = self._cancel, set()
        for r in filter(None, map(self.scheduler.withdraw, ids)):
            r.cancelled = True
            r.finish("cancelled", time.perf_counter())
            self.scheduler.finish(r)  # frees the slot and its KV reservation now
            self._notify(r, [])

    def _notify(self, r: Request, new: list[int]) -> None:
        if r.sink is None:
            return
        try:
            r.sink(r, new, r.finished)
        except Exception:  # noqa: BLE001 - a broken client bridge must not stop the step loop
            log.exception("sink of request %s failed: cancelling it", r.request_id)
            if not r.finished:
                self.cancel(r.request_id)

    def _finish_failed(self, r: Request, now: float) -> None:
        r.finish("error", now)
        self._notify(r, [])

    def _release(self, r: Request) -> None:
        self.scheduler.finish(r, r.e2e)
        for obs in self.observers:
            try:
                obs(r)
            except Exception:  # noqa: BLE001 - metrics/feedback trouble must not stop serving
                log.exception("finish observer failed on request %s", r.request_id)

    def start(self) -> None:
        """Run the step loop on a thread of its own (`serve`'s default, tests, the in-process bench)."""
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    def run_here(self) -> None:
        """Run the step loop on the calling thread until `request_stop` (`serve --step-loop main`
        runs it on its main thread: `serving.launch.STEP_LOOPS` says why); re-raises what made it
        give up."""
        self._thread = threading.current_thread()
        self._loop()

    def request_stop(self) -> None:
        """Ask the loop to end after its current step (any thread; does not wait)."""
        self._stop.set()
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        self.request_stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    stats = self.step()
                except Exception as exc:  # noqa: BLE001 - not pinned on one request: fail the step's
                    failures += 1
                    log.exception("engine step failed (%d in a row)", failures)
                    self.abort_running(exc)
                    if failures >= MAX_STEP_FAILURES:
                        raise
                    continue
                if stats is None:
                    self._wake.wait(0.05)
                    self._wake.clear()
                else:
                    failures = 0  # a step that did work: the trouble was not persistent
        except BaseException as exc:  # a bug: keep it visible on /health instead of a silent hang
            self.failure = exc
            self.abort_running(exc)
            for r in list(self.scheduler.pending):  # nobody will ever admit them: fail them now
                if self.scheduler.remove_pending(r):
                    r.fail(f"the engine stopped: {exc!r}", "server")
                    r.finish(None, time.perf_counter())
                    self._notify(r, [])
            raise

    def abort_running(self, exc: BaseException) -> None:
        """Fail every running request (a step raised and its state is unknown); free their slots
        so the loop can go on with the others still waiting."""
        for r in list(self.scheduler.running.values()):
            if not r.finished:
                r.fail(f"internal error in the engine step: {exc!r}", "server")
                r.finish(None, time.perf_counter())
            try:
                self.scheduler.finish(r)
            except Exception:  # noqa: BLE001
                log.exception("could not free the slot of %s", r.request_id)
            self._notify(r, [])

    def run_until_idle(self) -> None:
        """Drive the loop on the calling thread until nothing waits or runs (tests, benchmark)."""
        while self.step() is not None:
            pass
