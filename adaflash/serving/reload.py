"""Drafter hot reload: load and validate off the step loop, swap atomically between steps.

`DrafterReloader.reload(path)` loads the checkpoint on its own thread (`load_drafter_for` checks
the target fingerprint, shapes and every tensor), so the step loop keeps serving the old drafter
meanwhile. The read is bounded: only regular files within a size cap are read
(`models/checkpoint.py: _read_regular`, so a FIFO cannot block it), and a read that does not
finish within `timeout_s` (a hung network filesystem) is abandoned and the reload fails. Only a
fully validated bundle is staged; the engine installs it at the next step boundary
(`Engine.stage_drafter`), so no step ever mixes two drafters. A corrupt or mismatched
checkpoint raises `CheckpointError` with a one-line reason and the old drafter keeps serving.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING

from adaflash.errors import CheckpointError
from adaflash.models.checkpoint import WEIGHTS, DrafterBundle, load_drafter_for

if TYPE_CHECKING:  # annotations only
    from adaflash.serving.engine import Engine
    from adaflash.serving.metrics import ServingMetrics


def drafter_version(bundle: DrafterBundle, path: Path) -> str:
    """The registry's version when the checkpoint names one, else dir name + weights hash."""
    named = bundle.meta.lineage.get("version") if isinstance(bundle.meta.lineage, dict) else None
    if named:
        return str(named)
    digest = hashlib.sha256((path / WEIGHTS).read_bytes()).hexdigest()[:8]
    return f"{path.name}@{digest}"


def load_checked(engine: Engine, path: Path | str) -> DrafterBundle:
    """Load a drafter for this engine's target; raise CheckpointError when it cannot serve."""
    bundle = load_drafter_for(Path(path), engine.target, dtype=engine.model.dtype)
    if engine.config.method == "adaflash" and bundle.length_head is None:
        raise CheckpointError(f"drafter {path} has no length head, which method 'adaflash' needs")
    return bundle


# How long a reload may spend reading a checkpoint before it is abandoned (a hung filesystem).
RELOAD_TIMEOUT_S = float(os.environ.get("ADAFLASH_RELOAD_TIMEOUT_S", "300"))


class DrafterReloader:
    def __init__(
        self, engine: Engine, metrics: ServingMetrics | None = None, timeout_s: float = RELOAD_TIMEOUT_S
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter-reload")
        self._lock = threading.Lock()

    def reload(self, path: Path | str, version: str | None = None) -> Future:
        """Start loading `path`; the future yields the new version or raises CheckpointError."""
        return self._pool.submit(self._load, Path(path), version)

    def _load(self, path: Path, version: str | None) -> str:
        with self._lock:  # one reload at a time: the last one staged wins, never a mix
            try:
                bundle, version = self._read(path, version)
            except CheckpointError:
                if self.metrics is not None:
                    self.metrics.reloads.labels("rejected").inc()
                raise
            self.engine.stage_drafter(bundle, version)
            if self.metrics is not None:
                self.metrics.reloads.labels("ok").inc()
            return version

    def _read(self, path: Path, version: str | None) -> tuple[DrafterBundle, str]:
        """Load and name the checkpoint on a thread of its own, waiting at most `timeout_s`. A read
        stuck in the kernel (Python's reads release the GIL) is left behind on its daemon thread:
        this reload fails, the lock is released and the next reload can start."""
        done: Future = Future()

        def read() -> None:
            try:
                bundle = load_checked(self.engine, path)
                done.set_result((bundle, version or drafter_version(bundle, path)))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting reload
                done.set_exception(e)

        threading.Thread(target=read, name="drafter-read", daemon=True).start()
        try:
            return done.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise CheckpointError(
                f"reading drafter {path} did not finish within {self.timeout_s:g} s (a hung "
                "filesystem?): abandoned"
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
