"""`adaflash serve` stopped by SIGTERM (systemd, Kubernetes and `adaflash down` all send it) flushes
feedback exactly as Ctrl-C does (issue 32, finding 8): every request that finished before the
signal has its record on the broker, and the process exits 0. uvicorn re-raises the signal after
its graceful shutdown, and SIGTERM's default action used to end the process before the flush."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from adaflash.feedback import topics
from adaflash.feedback.broker import free_port
from adaflash.feedback.schema import parse_record
from tests.kafka_util import read_topic, running_broker

N_REQUESTS = 30


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("adaflash serve did not become healthy")


async def _burst(url: str, n: int, clients: int = 32) -> list[str]:
    """n requests from `clients` concurrent clients (within serve's default queue bound)."""
    gate = asyncio.Semaphore(clients)
    body = {"prompt": "tell me more", "max_tokens": 8, "temperature": 0}

    async def one(c: httpx.AsyncClient) -> httpx.Response:
        async with gate:
            return await c.post("/v1/completions", json=body)

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        rs = await asyncio.gather(*(one(c) for _ in range(n)))
    assert all(r.status_code == 200 for r in rs), [r.text[:200] for r in rs if r.status_code != 200]
    return [r.json()["id"].removeprefix("cmpl-") for r in rs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step_loop", ["thread", "main"])  # `main`: uvicorn on a thread of its own
def test_sigterm_flushes_every_finished_requests_feedback_record(tmp_path, step_loop):
    with running_broker(tmp_path / "broker") as broker:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        feedback = ["--bootstrap-servers", broker.bootstrap_servers, "--spool-dir", str(tmp_path / "spool")]
        argv = ["serve", "--target", "tiny", "--method", "ar", "--port", str(port), "--step-loop", step_loop,
                *feedback]  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "adaflash", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            _wait_healthy(proc, url)
            served = asyncio.run(_burst(url, N_REQUESTS))
            proc.send_signal(signal.SIGTERM)  # at once: the last records are still on their way
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        ids = [parse_record(m.value).request_id for m in read_topic(broker.bootstrap_servers, topics.RAW)]
    assert sorted(set(ids)) == sorted(served), f"{len(set(served) - set(ids))} of {len(served)} records lost"
    assert rc == 0, (rc, proc.stderr.read()[-2000:])  # a clean stop: a supervisor does not restart it
