"""The fault suite (issue 14, item 5): the whole loop on `tiny`, brought up with `adaflash up`,
closed-loop traffic throughout, and real faults injected into real processes one at a time.

After each fault the loop must come back by itself — the stack's supervisor restarts a service
that was killed — or through `adaflash up` (a service that exited cleanly, like a broker given
SIGTERM, is not restarted by the supervisor; `up` starts what is not running and leaves the rest
alone), and these invariants must hold:

- every request the server acknowledged (HTTP 200) has its feedback record in the lineage store,
  exactly once: one row per request (each request carries its own tenant id, so a row names the
  request). The embedded Tansu broker keeps topics in memory only, so records it had acknowledged
  but governance had not consumed yet die with it: those are counted as `broker loss`, never as
  `lost`, and only for a broker fault. Likewise the serving process holds the records of requests
  it has answered until its producer hands them to Kafka (or the spool): a SIGKILLed server loses
  those, counted as `server loss`, only for the fault that kills it;
- every governance batch has in = clean + quarantined + duplicate, and the clean buffer holds
  each record id once;
- no 5xx from the server, ever; no refused or reset connection except in the documented restart
  window of the one fault that kills the server (from the fault until it answers again);
- the server serves the registry's champion within 10 s of recovery;
- no planted PII value at rest anywhere under the stack's home.

The table (fault → recovered in N s → records lost / duplicated / broker loss / server loss) is
printed and, with ADAFLASH_FAULT_TABLE=path, written as JSON.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from adaflash.feedback.broker import free_port
from adaflash.procs import alive, pid_from_file

TOKEN = "fault-suite-admin"
WORDS = (
    "apple river stone cloud garden window silver engine morning candle forest harbor pencil "
    "orange bridge valley thunder copper meadow lantern rocket castle saddle marble ocean tiger "
    "violet basket mirror planet kettle ladder jacket falcon pepper rabbit velvet wagon summit"
).split()


# -- the stack, driven through the CLI ---------------------------------------------------------
class Loop:
    def __init__(self, root: Path, drafter: Path) -> None:
        self.home = root / "home"
        self.drafter = drafter
        self.broker_port, self.registry_port, self.port = free_port(), free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.tracking_uri = f"http://127.0.0.1:{self.registry_port}"
        self.ports = ["--broker-port", str(self.broker_port), "--registry-port", str(self.registry_port)]
        self.ports += ["--port", str(self.port)]
        self.env = {
            **os.environ,
            "ADAFLASH_HOME": str(self.home),
            "ADAFLASH_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "ADAFLASH_ADMIN_TOKEN": TOKEN,
            "MLFLOW_LOGGING_LEVEL": "WARNING",
        }

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "adaflash.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def up(self) -> float:
        t = time.monotonic()
        r = self.cli(
            "up", "--target", "tiny", "--drafter", str(self.drafter), "--min-records", "1000000", *self.ports
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return time.monotonic() - t

    def status_ok(self) -> bool:
        r = self.cli("status", *self.ports, timeout=60)
        self.last_status = r.stdout + r.stderr
        return r.returncode == 0

    def supervised(self, service: str) -> str:
        """What the supervisor says of a service: its restarts and last exit (for the table)."""
        r = self.cli("status", "--json", *self.ports, timeout=60)
        row = next(x for x in json.loads(r.stdout) if x["service"] == service)
        return f"{row['restarts']} supervisor restart(s), last exit {row['last_exit']}"

    def pid(self, service: str) -> int:
        f = {
            "broker": self.home / "broker" / "broker.json",
            "registry": self.home / "mlflow" / "server.json",
        }.get(service, self.home / "stack" / f"{service}.json")
        pid = pid_from_file(f)
        assert pid is not None, f"{service} is not running"
        return pid

    def health(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def lineage(self) -> sqlite3.Connection:
        db = sqlite3.connect(
            f"file:{self.home / 'governance' / 'lineage.sqlite'}?mode=ro", uri=True, timeout=30
        )
        db.execute("PRAGMA busy_timeout = 30000")
        return db

    def governed_tenants(self) -> Counter:
        path = self.home / "governance" / "lineage.sqlite"
        if not path.exists():
            return Counter()  # governance has not created the store yet
        for _ in range(20):
            try:
                with self.lineage() as db:
                    return Counter(t for (t,) in db.execute("SELECT tenant_id FROM records"))
            except sqlite3.OperationalError:  # a writer holds the lock: read again
                time.sleep(0.2)
        raise AssertionError("could not read the lineage store")

    def registry(self):
        from adaflash.models.targets import load_vocabulary
        from adaflash.registry.client import RegistryClient

        return RegistryClient(
            self.tracking_uri,
            load_vocabulary("tiny").fingerprint,
            bootstrap_servers=f"127.0.0.1:{self.broker_port}",
        )


def post(base: str, path: str, body: dict, headers: dict | None = None, timeout: float = 120):
    """(status, headers, json body); status 0 for a refused or reset connection."""
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")
    except (OSError, http.client.HTTPException):
        return 0, {}, {}


# -- closed-loop traffic -------------------------------------------------------------------------
class Traffic:
    """A small closed loop of clients: one request at a time per worker, each with its own tenant
    id (so its feedback record can be found by it), diverse prompts (the near-duplicate filter
    must not see a flood), and some with a planted PII value that must never reach the disk."""

    def __init__(self, base: str, workers: int = 2, max_tokens: int = 8) -> None:
        self.base, self.max_tokens = base, max_tokens
        self.acked: dict[str, float] = {}  # tenant → when the 200 came back
        self.errors: list[tuple[float, int, str]] = []  # (when, status, body) for 5xx / refused
        self.statuses: Counter = Counter()
        self.canaries: list[str] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def start(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def next_tenant(self, prefix: str = "ft") -> str:
        with self._lock:
            self._seq += 1
            return f"{prefix}-{self._seq:06d}"

    def prompt(self, rng: random.Random) -> str:
        from adaflash.governance.synthetic import CANARIES, PROMPT_TEMPLATES

        text = " ".join(rng.choice(WORDS) for _ in range(10)) + f" {rng.randrange(10**9)}"
        if rng.random() < 0.25:
            ent = rng.choice(["EMAIL_ADDRESS", "CREDIT_CARD", "US_SSN"])
            value = CANARIES[ent](rng)
            with self._lock:
                self.canaries.append(value)
            text = rng.choice(PROMPT_TEMPLATES[ent]).format(v=value) + " " + text
        return text

    def one(self, rng: random.Random, max_tokens: int | None = None) -> int:
        tenant = self.next_tenant()
        body = {
            "model": "adaflash",
            "prompt": self.prompt(rng),
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": 0,
        }
        status, _, out = post(self.base, "/v1/completions", body, {"X-Tenant-Id": tenant})
        with self._lock:
            self.statuses[status] += 1
            if status == 200:
                self.acked[tenant] = time.monotonic()
            elif status == 0 or status >= 500:
                self.errors.append((time.monotonic(), status, json.dumps(out)[:200]))
        return status

    def _run(self, i: int) -> None:
        rng = random.Random(1000 + i)
        while not self._stop.is_set():
            if self.one(rng) != 200:
                time.sleep(0.2)
            else:
                time.sleep(0.05)

    def acked_before(self, t: float) -> set[str]:
        with self._lock:
            return {k for k, v in self.acked.items() if v <= t}


def _proc_state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def wait_for(cond, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(every)


# -- the suite -----------------------------------------------------------------------------------
class Suite:
    def __init__(self, loop: Loop, traffic: Traffic) -> None:
        self.loop, self.traffic = loop, traffic
        self.rows: list[dict] = []
        self.canaries: list[str] = []  # planted on the raw topic directly
        self.champion: str | None = None
        self.memory_lost: set[str] = set()  # died with the memory-only broker or a killed server

    # invariants ------------------------------------------------------------------------------
    def check_batches(self) -> dict:
        with self.loop.lineage() as db:
            bad = db.execute(
                "SELECT batch_id, n_in, n_clean, n_quarantined, n_duplicate FROM batches "
                "WHERE n_in != n_clean + n_quarantined + n_duplicate"
            ).fetchall()
            tot = db.execute(
                "SELECT COALESCE(SUM(n_in),0), COALESCE(SUM(n_clean),0), COALESCE(SUM(n_quarantined),0), "
                "COALESCE(SUM(n_duplicate),0) FROM batches"
            ).fetchone()
        assert not bad, f"batches with in != clean + quarantined + duplicate: {bad}"
        return dict(zip(("in", "clean", "quarantined", "duplicate"), tot, strict=True))

    def check_buffer_unique(self) -> int:
        """Each record id once across the shards lineage registered (what training reads;
        unregistered leftovers of a killed batch are removed when governance starts)."""
        import pyarrow.parquet as pq

        with self.loop.lineage() as db:
            paths = [p for (p,) in db.execute("SELECT path FROM shards")]
        ids: Counter = Counter()
        for p in paths:
            ids.update(
                pq.read_table(self.loop.home / "governance" / "buffer" / p, columns=["record_id"])
                .column("record_id")
                .to_pylist()
            )
        dup = {k: n for k, n in ids.items() if n > 1}
        assert not dup, f"the clean buffer holds record ids more than once: {list(dup.items())[:5]}"
        return len(ids)

    def account(
        self, until: float, at_risk: set[str] = frozenset(), where: str = "broker_loss", timeout: float = 90
    ) -> dict:
        """Wait until every request acknowledged before `until` is governed; returns the counts.
        `at_risk`: requests whose records only the memory of the process that died held (the
        memory-only broker: `broker_loss`, the killed server: `server_loss`)."""
        want = self.traffic.acked_before(until) - self.memory_lost  # earlier faults counted those

        def missing():
            got = self.loop.governed_tenants()
            m = {t for t in want if got[t] == 0}
            return m if m - at_risk else None  # done when nothing outside the broker's loss is missing

        deadline = time.monotonic() + timeout
        m = missing()
        while m is not None and time.monotonic() < deadline:
            time.sleep(1)
            m = missing()
        got = self.loop.governed_tenants()
        gone = {t for t in want if got[t] == 0}
        duplicated = sum(1 for t in want if got[t] > 1)
        lost, memory_loss = gone - at_risk, gone & at_risk
        assert not lost, f"{len(lost)} acknowledged requests have no governed record: {sorted(lost)[:5]}"
        assert duplicated == 0, f"{duplicated} requests have more than one record after dedupe"
        self.memory_lost |= memory_loss
        return {"acked": len(want), "lost": len(lost), "duplicated": duplicated, where: len(memory_loss)}

    def no_errors_since(self, t: float) -> None:
        bad = [e for e in self.traffic.errors if e[0] >= t]
        assert not bad, f"5xx or refused connections outside a restart window: {bad[:5]}"

    def serves_champion(self, within: float = 10.0) -> float:
        with self.loop.registry() as reg:
            champion = reg.champion()
        t = time.monotonic()
        wait_for(
            lambda: (self.loop.health() or {}).get("drafter_version") == champion,
            within,
            f"the server to serve the champion v{champion}",
            0.2,
        )
        self.champion = champion
        return time.monotonic() - t

    def row(self, fault: str, t_fault: float, recovered: float, acct: dict, note: str = "") -> None:
        self.rows.append(
            {
                "fault": fault,
                "recovered_s": round(recovered - t_fault, 1),
                "acked": acct.get("acked", 0),
                "lost": acct.get("lost", 0),
                "duplicated": acct.get("duplicated", 0),
                "broker_loss": acct.get("broker_loss", 0),
                "server_loss": acct.get("server_loss", 0),
                "note": note,
            }
        )

    def recovered(self, what: str, timeout: float = 90) -> float:
        """The loop is whole again: `adaflash status` all up and a request answered."""
        try:
            wait_for(
                self.loop.status_ok, timeout, f"`adaflash status` to show every service up after {what}", 1
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.loop.last_status}") from None
        rng = random.Random(7)
        wait_for(lambda: self.traffic.one(rng) == 200, 30, f"a request to succeed after {what}", 0.5)
        return time.monotonic()

    # faults ----------------------------------------------------------------------------------
    def broker_kill(self, sig: signal.Signals) -> None:
        name = f"broker {'kill -9' if sig == signal.SIGKILL else 'kill -15'}"
        time.sleep(3)  # traffic flowing into the broker
        before = self.loop.governed_tenants()
        t_fault = time.monotonic()
        pid = self.loop.pid("broker")
        os.kill(pid, sig)
        # Records governance had not consumed when the broker died may be lost with its memory.
        at_risk = {t for t in self.traffic.acked_before(t_fault + 1.0) if before[t] == 0}
        wait_for(lambda: not alive(pid), 15, "the broker to exit")
        if sig == signal.SIGTERM:  # a clean exit (0): the supervisor leaves it down
            time.sleep(3)  # traffic keeps coming while the broker is down: the server spools it
            self.loop.up()  # starts the broker again (empty), leaves the rest alone
        recovered = self.recovered(name)  # kill -9: the supervisor restarts it
        how = "restarted by `adaflash up`" if sig == signal.SIGTERM else self.loop.supervised("broker")
        self.serves_champion()
        acct = self.account(time.monotonic(), at_risk)
        self.row(name, t_fault, recovered, acct, f"{len(at_risk)} records at risk in broker memory; {how}")
        self.no_errors_since(t_fault)

    def governance_kill(self) -> None:
        """SIGKILL governance while it is inside a batch of planted records; `up` restarts it."""
        from kafka import KafkaProducer

        from adaflash.governance.synthetic import TrafficGenerator
        from adaflash.models.targets import load_vocabulary

        gen = TrafficGenerator(load_vocabulary("tiny"), ["Summarise the attached report."], seed=3)
        msgs = []
        for i in range(240):
            rec, can = gen.record(
                pii=i % 4 == 0,
                tenant=f"gk-{i:04d}",
                prompt=f"planted {i} " + " ".join(random.Random(i).choice(WORDS) for _ in range(8)),
            )
            self.canaries += [v for _, v in can]
            msgs.append(rec)
        producer = KafkaProducer(bootstrap_servers=f"127.0.0.1:{self.loop.broker_port}", acks="all")
        for f in [
            producer.send("adaflash.feedback.raw", key=r.tenant_id.encode(), value=r.to_bytes()) for r in msgs
        ]:
            f.get(timeout=30)
        producer.close()
        planted = {r.tenant_id for r in msgs}
        # Kill once governance is working on them: some planted records governed, not all.
        wait_for(lambda: planted & set(self.loop.governed_tenants()) or True, 1, "")
        time.sleep(1.5)
        done_at_kill = len(planted & set(self.loop.governed_tenants()))
        t_fault = time.monotonic()
        pid = self.loop.pid("governance")
        os.kill(pid, signal.SIGKILL)
        assert done_at_kill < len(planted), "governance had finished before the kill: not mid-batch"
        wait_for(lambda: not alive(pid), 15, "governance to exit")
        recovered = self.recovered("governance SIGKILL")  # restarted by the supervisor
        wait_for(lambda: planted <= set(self.loop.governed_tenants()), 120, "every planted record governed")
        got = self.loop.governed_tenants()
        assert all(got[t] == 1 for t in planted), "a planted record was governed twice"
        acct = self.account(time.monotonic())
        acct["acked"] += len(planted)
        self.row(
            "governance SIGKILL mid-batch",
            t_fault,
            recovered,
            acct,
            f"{done_at_kill}/{len(planted)} planted governed at the kill; "
            + self.loop.supervised("governance"),
        )
        self.no_errors_since(t_fault)

    def poison(self) -> None:
        """Poison requests (4xx, the server keeps serving) and poison records on the raw topic
        (quarantined with a reason, the batch and the ones after go on)."""
        from kafka import KafkaProducer

        t_fault = time.monotonic()
        b = self.loop.base
        bodies = [
            {"model": "adaflash", "prompt": "hi", "max_tokens": 4, "temperature": 1e-40},
            {"model": "adaflash", "prompt": "a\ud800b", "max_tokens": 4},
            {"model": "adaflash", "prompt": [-1, 5], "max_tokens": 4},
            {"model": "adaflash", "prompt": "hi", "max_tokens": 4, "seed": 2**64},
            {"model": "adaflash", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            {"model": "adaflash", "prompt": "hi", "max_tokens": 0},
            {"model": "no-such-model", "prompt": "hi", "max_tokens": 4},
            {"model": "adaflash", "prompt": "hi", "max_tokens": 10**9},
        ]
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            status, _, out = post(b, path, body, {"X-Tenant-Id": "poison"})
            # A temperature of 1e-40 may be clamped and served (200); everything else is refused.
            ok = status == 200 if body.get("temperature") == 1e-40 else 400 <= status < 500
            assert ok or 400 <= status < 500, (body, status, out)
            assert status < 500 and status != 0, (body, status, out)
            assert (self.loop.health() or {}).get("status") == "ok", f"unhealthy after poison request {body}"
        with self.loop.lineage() as db:
            batches_before = {r[0] for r in db.execute("SELECT batch_id FROM batches")}
        deep = b"[" * 10_000 + b"]" * 10_000
        big = json.dumps({"record_id": "poison-big", "prompt_text": "x" * 5_000_000}).encode()
        values = [deep, big, b"\xff\xfe not json", b'{"schema_version": 1, "record_id": 7}']
        producer = KafkaProducer(
            bootstrap_servers=f"127.0.0.1:{self.loop.broker_port}",
            acks="all",
            max_request_size=8 * 1024 * 1024,
        )
        metas = [
            producer.send("adaflash.feedback.raw", key=b"poison", value=v).get(timeout=30) for v in values
        ]
        producer.close()
        offsets = {(m.partition, m.offset) for m in metas}

        def quarantined():
            with self.loop.lineage() as db:
                rows = db.execute(
                    'SELECT partition, "offset", status, reasons, batch_id FROM records'
                ).fetchall()
            return [r for r in rows if (r[0], r[1]) in offsets and r[4] not in batches_before]

        rows = wait_for(
            lambda: len(quarantined()) >= len(values) and quarantined(), 90, "poison records governed"
        )
        assert all(r[2] == "quarantined" and json.loads(r[3]) for r in rows), rows
        recovered = self.recovered("poison")
        self.serves_champion()
        acct = self.account(time.monotonic())
        self.row(
            "poison requests + poison records",
            t_fault,
            recovered,
            acct,
            f"{len(bodies)} requests refused 4xx; {len(values)} records quarantined: "
            + ", ".join(sorted({c for r in rows for c, _ in json.loads(r[3])})),
        )
        self.no_errors_since(t_fault)

    def overload(self, capacity: int = 96) -> None:
        """4× the server's capacity (32 running + 64 queued) at once: 429s, never a 5xx."""
        t_fault = time.monotonic()
        n = 4 * capacity
        rngs = [random.Random(5000 + i) for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            codes = Counter(pool.map(lambda r: self.traffic.one(r, max_tokens=64), rngs))
        assert codes[429] > 0, f"4x overload produced no 429: {codes}"
        assert all(c in (200, 429) for c in codes), f"overload answered with {codes}"
        assert (self.loop.health() or {}).get("status") == "ok"
        recovered = self.recovered("overload")
        self.serves_champion()
        acct = self.account(time.monotonic())
        self.row(
            f"4x overload ({n} at once)", t_fault, recovered, acct, f"200: {codes[200]}, 429: {codes[429]}"
        )
        self.no_errors_since(t_fault)

    def corrupt_challenger(self, tmp: Path) -> None:
        """A challenger with a truncated safetensors file: register refuses it, and so does a
        direct reload; the champion keeps serving."""
        with self.loop.registry() as reg:
            n_before = len(reg.versions())
        t_fault = time.monotonic()
        bad = tmp / "corrupt"
        shutil.copytree(self.loop.drafter, bad)
        st = next(bad.glob("*.safetensors"))
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
        r = self.loop.cli(
            "registry",
            "register",
            str(bad),
            "--target",
            "tiny",
            "--tracking-uri",
            self.loop.tracking_uri,
            "--bootstrap-servers",
            f"127.0.0.1:{self.loop.broker_port}",
            "--reason",
            "fault suite: corrupt challenger",
        )
        assert r.returncode != 0 and "error" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
        with self.loop.registry() as reg:
            n_versions = len(reg.versions())
            assert n_versions == n_before and reg.champion() == self.champion, (
                "the corrupt drafter became a version"
            )
        status, _, out = post(
            self.loop.base,
            "/admin/drafter/reload",
            {"path": str(bad), "version": "corrupt"},
            {"Authorization": f"Bearer {TOKEN}"},
        )
        assert status == 422, (status, out)
        assert (self.loop.health() or {}).get("drafter_version") == self.champion
        recovered = self.recovered("corrupt challenger")
        self.serves_champion()
        acct = self.account(time.monotonic())
        self.row(
            "corrupt challenger",
            t_fault,
            recovered,
            acct,
            f"register refused (exit {r.returncode}), reload 422; {n_versions} versions",
        )
        self.no_errors_since(t_fault)

    def mlflow_restart_during_promotion(self, challenger: Path) -> None:
        """SIGKILL MLflow while a promotion is in flight; after `up` restarts it the aliases are
        consistent, a retried promotion completes and the server serves the new champion."""
        with self.loop.registry() as reg:
            v2 = reg.register(challenger, lineage={"source": "fault suite"}, reason="fault suite challenger")
        outcome: list = []

        def promote():
            try:
                with self.loop.registry() as reg:
                    outcome.append(
                        reg.promote(v2, who="fault-suite", reason="promotion under an MLflow kill")
                    )
            except Exception as e:  # noqa: BLE001 - the fault may fail it; that is the point
                outcome.append(e)

        th = threading.Thread(target=promote)
        th.start()
        time.sleep(0.05)
        t_fault = time.monotonic()
        pid = self.loop.pid("registry")
        os.killpg(pid, signal.SIGKILL)
        th.join(120)
        wait_for(lambda: not alive(pid), 15, "MLflow to exit")
        recovered = self.recovered("MLflow SIGKILL during a promotion")  # restarted by the supervisor
        with self.loop.registry() as reg:
            if reg.champion() != v2:
                reg.promote(v2, who="fault-suite", reason="retry after the MLflow restart")
            assert reg.champion() == v2
        took = self.serves_champion()
        acct = self.account(time.monotonic())
        first = "completed" if outcome and not isinstance(outcome[0], Exception) else f"failed: {outcome[:1]}"
        self.row(
            "MLflow SIGKILL during a promotion",
            t_fault,
            recovered,
            acct,
            f"in-flight promote {first[:60]}; champion v{v2} served {took:.1f}s after; "
            + self.loop.supervised("registry"),
        )
        self.no_errors_since(t_fault)

    def fleet_controller_kill(self) -> None:
        """On the embedded stack the serving process is its own fleet controller: its champion
        follower makes each new champion live. Freeze it (SIGSTOP) so that the follower cannot
        act, move the champion alias (a rollback: alias move + event), and kill -9 it: it dies
        between the alias move and the reload, the event consumed by no one. The supervisor
        restarts it and at start-up it loads the registry's champion, before it answers.
        Restart window: from the freeze until a request succeeds again."""
        with self.loop.registry() as reg:
            before = reg.champion()
        time.sleep(2)  # traffic flowing
        pid = self.loop.pid("serve")
        t_fault = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: _proc_state(pid) in ("T", "t"), 5, "the server to freeze", 0.05)
        with self.loop.registry() as reg:
            event = reg.rollback(who="fault-suite", reason="alias move with the fleet controller frozen")
        assert event.version != before
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        # Records of requests it answered that governance has not seen may have died with it.
        governed = self.loop.governed_tenants()
        at_risk = {t for t in self.traffic.acked_before(t_kill) if governed[t] == 0}
        wait_for(lambda: not alive(pid), 15, "the server to exit")
        recovered = self.recovered("the fleet controller kill")
        took = self.serves_champion()  # the registry's champion: the version the alias moved to
        assert self.champion == event.version
        window = [e for e in self.traffic.errors if t_fault <= e[0] <= recovered]
        assert all(status == 0 for _, status, _ in window), f"5xx in the restart window: {window[:5]}"
        acct = self.account(time.monotonic(), at_risk, where="server_loss")
        self.row(
            "fleet controller (serve) kill -9 between alias move and reload",
            t_fault,
            recovered,
            acct,
            f"v{before} → v{event.version} moved while frozen; v{event.version} served {took:.1f}s after "
            f"recovery; restart window {recovered - t_fault:.1f}s: {len(window)} refused/reset, 0 5xx; "
            f"{len(at_risk)} records at risk in server memory; {self.loop.supervised('serve')}",
        )
        self.no_errors_since(recovered)

    def privacy(self) -> int:
        values = set(self.canaries) | set(self.traffic.canaries)
        assert values
        found = []
        for p in self.loop.home.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                found += [(str(p), v) for v in values if v.encode() in data]
        assert not found, f"PII at rest: {found[:3]}"
        return len(values)

    def table(self) -> str:
        lines = [
            "| fault | recovered in | acked so far | lost | duplicated | broker loss | server loss | note |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r['fault']} | {r['recovered_s']:.1f} s | {r['acked']} | {r['lost']} | "
                f"{r['duplicated']} | {r['broker_loss']} | {r['server_loss']} | {r['note']} |"
            )
        return "\n".join(lines)


def test_fault_suite(tmp_path, drafters):
    t_start = time.monotonic()
    loop = Loop(tmp_path, drafters[0])
    traffic = Traffic(loop.base)
    suite = Suite(loop, traffic)
    try:
        loop.up()
        with loop.registry() as reg:
            v1 = reg.register(loop.drafter, lineage={"source": "fault suite"}, reason="fault suite bootstrap")
            reg.promote(v1, who="fault-suite", reason="first champion")
        suite.serves_champion(60)
        traffic.start()
        time.sleep(2)
        suite.governance_kill()
        suite.broker_kill(signal.SIGKILL)
        suite.broker_kill(signal.SIGTERM)
        suite.poison()
        suite.overload()
        suite.corrupt_challenger(tmp_path)
        suite.mlflow_restart_during_promotion(drafters[1])
        suite.fleet_controller_kill()
        traffic.stop()
        totals = suite.check_batches()
        clean_ids = suite.check_buffer_unique()
        pii = suite.privacy()
    finally:
        traffic.stop()
        print("\n" + suite.table())
        down = loop.cli("down", *loop.ports)
        print(down.stdout, down.stderr)
    wall = time.monotonic() - t_start
    print(
        f"totals {totals}; {clean_ids} record ids in the clean buffer, each once; {pii} planted PII "
        f"values, none at rest; traffic {dict(traffic.statuses)}; {wall:.0f}s"
    )
    if os.environ.get("ADAFLASH_FAULT_TABLE"):
        Path(os.environ["ADAFLASH_FAULT_TABLE"]).write_text(
            json.dumps(
                {
                    "faults": suite.rows,
                    "totals": totals,
                    "seconds": round(wall),
                    "traffic": dict(traffic.statuses),
                },
                indent=2,
                default=str,
            )
        )
