"""The lineage store: which record went where and why, and which drafter versions it fed.

SQLite (WAL) next to the replay buffer. One transaction per governance batch writes the record
rows, the shards and the audit entry together, so the store either knows a whole batch or none of
it — the service's crash safety rests on that. Nothing here holds text: ids, tenants, offsets,
reasons (codes + expectation names), entity-type counts.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    record_id TEXT PRIMARY KEY,
    tenant_id TEXT,
    status TEXT NOT NULL,            -- clean | quarantined
    reasons TEXT NOT NULL,           -- JSON [[code, detail], ...]
    shard_id TEXT,
    topic TEXT NOT NULL, partition INTEGER NOT NULL, "offset" INTEGER NOT NULL,
    batch_id TEXT NOT NULL,
    created_at REAL,                 -- event time (epoch seconds)
    prompt_minhash TEXT              -- rebuilds the near-duplicate window after a restart
);
CREATE INDEX IF NOT EXISTS records_tenant ON records(tenant_id);
CREATE INDEX IF NOT EXISTS records_shard ON records(shard_id);
CREATE INDEX IF NOT EXISTS records_created ON records(created_at);
CREATE TABLE IF NOT EXISTS shards (
    shard_id TEXT PRIMARY KEY, path TEXT NOT NULL, tenant_id TEXT NOT NULL, date TEXT NOT NULL,
    n_records INTEGER NOT NULL, batch_id TEXT NOT NULL, created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY, started_at TEXT, finished_at TEXT, offsets TEXT,
    n_in INTEGER, n_clean INTEGER, n_quarantined INTEGER, n_duplicate INTEGER,
    reasons TEXT, pii_entities TEXT, seconds REAL
);
CREATE TABLE IF NOT EXISTS quarantined_payloads (  -- what makes a quarantined message a duplicate
    record_id TEXT NOT NULL, sha256 TEXT NOT NULL,   -- its id and the hash of its bytes
    PRIMARY KEY (record_id, sha256)
);
CREATE TABLE IF NOT EXISTS trained_on (       -- shards a version's run consumed (train + held-out)
    shard_id TEXT NOT NULL, model_version TEXT NOT NULL, at TEXT NOT NULL,
    PRIMARY KEY (shard_id, model_version)
);
CREATE TABLE IF NOT EXISTS trained_records (   -- the exact records a version trained on
    record_id TEXT NOT NULL, model_version TEXT NOT NULL,
    PRIMARY KEY (record_id, model_version)
);
"""


@dataclass
class RecordRow:
    record_id: str
    tenant_id: str | None
    status: str
    reasons: list[tuple[str, str]]
    shard_id: str | None
    topic: str
    partition: int
    offset: int
    created_at: float | None
    prompt_minhash: tuple[int, ...] | None
    payload_sha256: str | None = None  # of the message's bytes: a quarantined one's redelivery is a duplicate


@dataclass
class ShardRow:
    shard_id: str
    path: str
    tenant_id: str
    date: str
    n_records: int


@dataclass
class BatchAudit:
    batch_id: str
    started_at: str
    finished_at: str
    offsets: dict[str, list[int]]  # "topic/partition" -> [first, last]
    n_in: int
    n_clean: int
    n_quarantined: int
    n_duplicate: int
    reasons: dict[str, int] = field(default_factory=dict)
    pii_entities: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class LineageStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._db.row_factory = sqlite3.Row

    def close(self) -> None:
        self._db.close()

    # -- governance writes ------------------------------------------------------------------------
    def _in_chunks(self, query: str, record_ids: list[str]) -> Iterator[tuple]:
        for i in range(0, len(record_ids), 500):
            chunk = record_ids[i : i + 500]
            yield from self._db.execute(query.format(ids=",".join("?" * len(chunk))), chunk)

    def clean_ids(self, record_ids: list[str]) -> set[str]:
        """The ids among `record_ids` that some governed record already holds as clean."""
        q = "SELECT record_id FROM records WHERE status = 'clean' AND record_id IN ({ids})"
        return {r[0] for r in self._in_chunks(q, record_ids)}

    def quarantined_payloads(self, record_ids: list[str]) -> set[tuple[str, str]]:
        """(id, sha256 of the bytes) of quarantined messages with these ids."""
        q = "SELECT record_id, sha256 FROM quarantined_payloads WHERE record_id IN ({ids})"
        return {(r[0], r[1]) for r in self._in_chunks(q, record_ids)}

    def commit_batch(self, audit: BatchAudit, records: list[RecordRow], shards: list[ShardRow]) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            # A quarantined id does not hold its record id against a later valid record (issue 32):
            # the id's next outcome replaces a quarantined row; a clean row is final.
            db.executemany(
                "INSERT INTO records VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(record_id) DO UPDATE SET "
                "tenant_id=excluded.tenant_id, status=excluded.status, reasons=excluded.reasons, "
                "shard_id=excluded.shard_id, topic=excluded.topic, partition=excluded.partition, "
                '"offset"=excluded."offset", batch_id=excluded.batch_id, created_at=excluded.created_at, '
                "prompt_minhash=excluded.prompt_minhash WHERE records.status = 'quarantined'",
                [
                    (
                        r.record_id,
                        r.tenant_id,
                        r.status,
                        json.dumps(r.reasons),
                        r.shard_id,
                        r.topic,
                        r.partition,
                        r.offset,
                        audit.batch_id,
                        r.created_at,
                        ",".join(map(str, r.prompt_minhash)) if r.prompt_minhash is not None else None,
                    )
                    for r in records
                ],
            )
            db.executemany(
                "INSERT OR IGNORE INTO quarantined_payloads VALUES (?,?)",
                [
                    (r.record_id, r.payload_sha256)
                    for r in records
                    if r.status == "quarantined" and r.payload_sha256
                ],
            )
            db.executemany(
                "INSERT OR REPLACE INTO shards VALUES (?,?,?,?,?,?,?)",
                [
                    (s.shard_id, s.path, s.tenant_id, s.date, s.n_records, audit.batch_id, audit.finished_at)
                    for s in shards
                ],
            )
            a = asdict(audit)
            db.execute(
                "INSERT INTO batches VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    a["batch_id"],
                    a["started_at"],
                    a["finished_at"],
                    json.dumps(a["offsets"]),
                    a["n_in"],
                    a["n_clean"],
                    a["n_quarantined"],
                    a["n_duplicate"],
                    json.dumps(a["reasons"]),
                    json.dumps(a["pii_entities"]),
                    a["seconds"],
                ),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def shard_ids(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT shard_id FROM shards")}

    def recent(self, since: float) -> Iterator[tuple[str | None, float, tuple[int, ...] | None]]:
        """(tenant, event time, prompt MinHash) of records governed since `since`, oldest first."""
        q = (
            "SELECT tenant_id, created_at, prompt_minhash FROM records "
            "WHERE created_at >= ? ORDER BY created_at"
        )
        for tenant, ts, h in self._db.execute(q, (since,)):
            yield tenant, ts, tuple(int(x) for x in h.split(",")) if h else None

    def latest_event_time(self) -> float | None:
        return self._db.execute("SELECT MAX(created_at) FROM records").fetchone()[0]

    # -- training / registry writes ----------------------------------------------------------------
    def mark_trained(
        self, shard_ids: list[str], model_version: str, at: str, record_ids: list[str] | None = None
    ) -> None:
        """Shards consumed by a run (never ingested again) and, exactly, the records it trained on."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        db.executemany(
            "INSERT OR IGNORE INTO trained_on VALUES (?,?,?)", [(s, model_version, at) for s in shard_ids]
        )
        db.executemany(
            "INSERT OR IGNORE INTO trained_records VALUES (?,?)",
            [(r, model_version) for r in record_ids or []],
        )
        db.execute("COMMIT")

    def untrained_shards(self) -> list[dict]:
        """Shards no drafter version has trained on yet, oldest first."""
        q = (
            "SELECT * FROM shards WHERE shard_id NOT IN (SELECT shard_id FROM trained_on) "
            "ORDER BY created_at, shard_id"
        )
        return [dict(r) for r in self._db.execute(q)]

    def trained_shards(self) -> list[dict]:
        """Shards some drafter version has already trained on (the replay window's pool)."""
        q = (
            "SELECT * FROM shards WHERE shard_id IN (SELECT shard_id FROM trained_on) "
            "ORDER BY created_at, shard_id"
        )
        return [dict(r) for r in self._db.execute(q)]

    def records_for_version(self, model_version: str) -> list[str]:
        """Record ids in the shards a drafter version trained on (lineage from a model back)."""
        q = "SELECT record_id FROM trained_records WHERE model_version = ? ORDER BY record_id"
        return [row[0] for row in self._db.execute(q, (model_version,))]

    # -- queries (CLI) -------------------------------------------------------------------------------
    def record(self, record_id: str) -> dict | None:
        row = self._db.execute("SELECT * FROM records WHERE record_id = ?", (record_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["reasons"] = json.loads(out["reasons"])
        out.pop("prompt_minhash", None)
        out["shard"] = self.shard(out["shard_id"]) if out["shard_id"] else None
        q = "SELECT model_version FROM trained_records WHERE record_id = ? ORDER BY model_version"
        out["trained_into"] = [r[0] for r in self._db.execute(q, (record_id,))]
        out["shard_consumed_by"] = self._versions(out["shard_id"])
        return out

    def _versions(self, shard_id: str | None) -> list[str]:
        if not shard_id:
            return []
        q = "SELECT model_version FROM trained_on WHERE shard_id = ? ORDER BY at"
        return [r[0] for r in self._db.execute(q, (shard_id,))]

    def shard(self, shard_id: str) -> dict | None:
        row = self._db.execute("SELECT * FROM shards WHERE shard_id = ?", (shard_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["trained_into"] = self._versions(shard_id)
        return out

    def shards(self, tenant_id: str | None = None) -> list[dict]:
        q, args = "SELECT * FROM shards", ()
        if tenant_id is not None:
            q, args = q + " WHERE tenant_id = ?", (tenant_id,)
        return [dict(r) for r in self._db.execute(q + " ORDER BY created_at", args)]

    def tenant(self, tenant_id: str) -> dict:
        counts = dict(
            self._db.execute(
                "SELECT status, COUNT(*) FROM records WHERE tenant_id = ? GROUP BY status", (tenant_id,)
            ).fetchall()
        )
        reasons: dict[str, int] = {}
        q = "SELECT reasons FROM records WHERE tenant_id = ? AND status = 'quarantined'"
        for (rs,) in self._db.execute(q, (tenant_id,)):
            for code in {c for c, _ in json.loads(rs)}:
                reasons[code] = reasons.get(code, 0) + 1
        return {
            "tenant_id": tenant_id,
            "clean": counts.get("clean", 0),
            "quarantined": counts.get("quarantined", 0),
            "quarantine_reasons": reasons,
            "shards": len(self.shards(tenant_id)),
        }

    def audit(self, limit: int = 20) -> list[dict]:
        rows = self._db.execute("SELECT * FROM batches ORDER BY finished_at DESC LIMIT ?", (limit,))
        out = []
        for r in rows:
            d = dict(r)
            for k in ("offsets", "reasons", "pii_entities"):
                d[k] = json.loads(d[k])
            out.append(d)
        return out

    def totals(self) -> dict:
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(n_in),0), COALESCE(SUM(n_clean),0), "
            "COALESCE(SUM(n_quarantined),0), COALESCE(SUM(n_duplicate),0) FROM batches"
        ).fetchone()
        return dict(zip(("batches", "in", "clean", "quarantined", "duplicate"), row, strict=True))
