"""Reload safety (issue 32, finding 7): a drafter reload can never freeze the process.

safetensors' `safe_open` opens its file in Rust while it holds the GIL, so a FIFO (or a file on a
hung network filesystem) as `model.safetensors` froze the whole server: /health, generation and
the step loop. The server runs here in its own process (a frozen interpreter cannot time itself
out), and the test drives it over HTTP like the champion follower and `POST /admin/drafter/reload` do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from adaflash.errors import CheckpointError
from adaflash.feedback.broker import free_port
from adaflash.models.checkpoint import load_drafter, save_drafter
from tests.conftest import make_bundle

TOKEN = "reload-safety-token"
SERVER = """
import sys, time
from pathlib import Path
from adaflash.models.checkpoint import load_drafter_for
from adaflash.models.targets import tiny_target
from adaflash.serving.engine import Engine, EngineConfig
from adaflash.serving.server import ServerSettings, ServerThread, create_app

target = tiny_target()
bundle = load_drafter_for(Path(sys.argv[1]), target)
engine = Engine(target, bundle, EngineConfig(method="adaflash", max_running=4), "A")
engine.start()
ServerThread(create_app(engine, ServerSettings(admin_token=sys.argv[3])), port=int(sys.argv[2])).start()
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny):
    b = make_bundle(tiny, block_size=8, seed=3)
    return save_drafter(tmp_path_factory.mktemp("drafters") / "A", b.drafter, b.length_head, b.meta)


def _with_fifo(good: Path, dst: Path, name: str) -> Path:
    shutil.copytree(good, dst)
    (dst / name).unlink()
    os.mkfifo(dst / name)
    return dst


@pytest.mark.parametrize("name", ["config.json", "adaflash.json"])
def test_a_fifo_in_a_checkpoint_is_refused_without_blocking(good, tmp_path, name):
    """The loader's own check, in process: no file of a checkpoint is read unless it is a regular
    file, so this returns at once instead of blocking in open(). (Only files Python reads: a FIFO
    as the weights froze the whole interpreter before the fix, so that case runs in a subprocess.)"""
    bad = _with_fifo(good, tmp_path / "fifo", name)
    t = time.monotonic()
    with pytest.raises(CheckpointError, match="not a regular file"):
        # On today's code this blocks for good: run it where a hang cannot take pytest down.
        _in_thread(lambda: load_drafter(bad), timeout=10)
    assert time.monotonic() - t < 5


def _in_thread(fn, timeout: float):
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out.append(("err", e))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    assert out, f"still blocked after {timeout}s"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value


def test_a_fifo_as_weights_fails_the_reload_and_health_stays_up(good, tmp_path):
    bad = _with_fifo(good, tmp_path / "fifo-weights", "model.safetensors")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(good), str(port), TOKEN],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        result: dict = {}

        def reload():
            try:
                body = {"path": str(bad), "version": "B"}
                auth = {"Authorization": f"Bearer {TOKEN}"}
                result["r"] = httpx.post(f"{url}/admin/drafter/reload", json=body, headers=auth, timeout=30)
            except httpx.HTTPError as e:
                result["r"] = e

        th = threading.Thread(target=reload, daemon=True)
        th.start()
        worst = 0.0
        deadline = time.monotonic() + 3  # /health, again and again, while the reload runs
        while time.monotonic() < deadline:
            t = time.monotonic()
            try:
                h = httpx.get(f"{url}/health", timeout=2)
            except httpx.TimeoutException:
                pytest.fail("/health did not answer within 2 s during the reload: the process is frozen")
            worst = max(worst, time.monotonic() - t)
            assert h.status_code == 200 and h.json()["drafter_version"] == "A"
            time.sleep(0.1)
        assert worst < 1.0, f"/health took {worst:.2f}s during the reload"
        th.join(30)
        r = result["r"]
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 422, r.text
        msg = r.json()["error"]["message"]
        assert "still serving A" in msg and "not a regular file" in msg and "model.safetensors" in msg
        # The old drafter keeps serving.
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=30).json()
        assert out["adaflash"]["drafter_version"] == "A"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_read_that_hangs_is_abandoned_and_the_next_reload_still_runs(good, tiny, monkeypatch):
    """A hung network filesystem cannot be made here, so the read is replaced by one that blocks
    until released (in the kernel, a hung read releases the GIL just the same): the reload fails
    after its timeout with a clear error, the old drafter keeps serving, and the reloader is free
    for the next reload instead of queueing behind the stuck read."""
    from adaflash.serving import reload as reload_mod
    from adaflash.serving.engine import Engine, EngineConfig

    engine = Engine(tiny, load_drafter(good), EngineConfig(method="adaflash", max_running=2), "A")
    engine.start()
    reloader = reload_mod.DrafterReloader(engine, timeout_s=0.5)
    release = threading.Event()
    real = reload_mod.load_checked

    def hung(engine, path):
        release.wait(30)
        return real(engine, path)

    try:
        monkeypatch.setattr(reload_mod, "load_checked", hung)
        t = time.monotonic()
        with pytest.raises(CheckpointError, match="did not finish within 0.5 s"):
            reloader.reload(good, "B").result(timeout=10)
        assert time.monotonic() - t < 5 and engine.drafter_version == "A"
        monkeypatch.setattr(reload_mod, "load_checked", real)
        assert reloader.reload(good, "C").result(timeout=30) == "C"  # not stuck behind the hung read
    finally:
        release.set()
        reloader.close()
        engine.stop()
