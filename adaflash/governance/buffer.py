"""The replay buffer: clean records as content-hashed Parquet shards, by tenant and date.

`root/tenant=<id>/date=<YYYY-MM-DD>/shard-<sha256[:16]>.parquet`. A shard is written to a temp
file, fsynced and renamed, so it is either whole or absent. The lineage store is the index: a shard
on disk that the store does not list (a crash between the rename and the store's commit) is an
orphan whose records will be redelivered, and `remove_orphans` deletes it on start.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from adaflash.feedback.schema import CleanRecord


@dataclass(frozen=True)
class ShardInfo:
    shard_id: str
    path: Path
    tenant_id: str
    date: str
    n_records: int


@dataclass(frozen=True)
class ShardRead:
    records: list[CleanRecord]
    bad_rows: int  # rows that did not validate
    error: str | None  # why the file could not be read at all; None when it could


class ReplayBuffer:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def write_shard(self, tenant_id: str, date: str, records: list[CleanRecord]) -> ShardInfo:
        import pyarrow as pa
        import pyarrow.parquet as pq

        records = sorted(records, key=lambda c: c.record.record_id)
        payloads = [c.model_dump_json() for c in records]
        digest = hashlib.sha256("\n".join(payloads).encode()).hexdigest()[:16]
        table = pa.table(
            {
                "record_id": [c.record.record_id for c in records],
                "tenant_id": [c.record.tenant_id for c in records],
                "created_at": pa.array([c.record.created_at for c in records], pa.timestamp("us", tz="UTC")),
                "domain": [c.record.domain for c in records],
                "target_fingerprint": [c.record.target_fingerprint for c in records],
                "drafter_version": [c.record.drafter_version for c in records],
                "n_rounds": [len(c.record.rounds) for c in records],
                "prompt_token_ids": pa.array(
                    [c.record.prompt_token_ids for c in records], pa.list_(pa.int32())
                ),
                "output_token_ids": pa.array(
                    [c.record.output_token_ids for c in records], pa.list_(pa.int32())
                ),
                "clean_record": payloads,  # the full governed record (schema in adaflash.feedback)
            }
        )
        folder = self.root / f"tenant={tenant_id}" / f"date={date}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"shard-{digest}.parquet"
        tmp = folder / f".shard-{digest}.parquet.tmp"
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(path)
        return ShardInfo(digest, path, tenant_id, date, len(records))

    def shard_files(self) -> list[Path]:
        return sorted(self.root.glob("tenant=*/date=*/shard-*.parquet"))

    def remove_orphans(self, registered: set[str]) -> list[Path]:
        removed = []
        for p in [*self.shard_files(), *self.root.glob("tenant=*/date=*/.shard-*.tmp")]:
            if p.suffix == ".tmp" or p.stem.removeprefix("shard-") not in registered:
                p.unlink()
                removed.append(p)
        return removed

    @staticmethod
    def read_shard(path: Path) -> list[CleanRecord]:
        import pyarrow.parquet as pq

        col = pq.read_table(path, columns=["clean_record"]).column("clean_record").to_pylist()
        return [CleanRecord.model_validate_json(x) for x in col]

    @staticmethod
    def read_shard_tolerant(path: Path) -> ShardRead:
        """The shard's records that read back, and why the rest did not: a file that is not
        Parquet (torn, truncated, gone) is skipped whole, a row that does not validate (a
        non-finite number stored as null before issue 32) alone."""
        import pyarrow.parquet as pq
        from pydantic import ValidationError

        try:
            col = pq.read_table(path, columns=["clean_record"]).column("clean_record").to_pylist()
        except (OSError, ValueError, KeyError) as e:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
            return ShardRead([], 0, f"{type(e).__name__}: {e}")
        records, bad = [], 0
        for x in col:
            try:
                records.append(CleanRecord.model_validate_json(x or ""))
            except ValidationError:
                bad += 1
        return ShardRead(records, bad, None)

    def records(self, shard_paths: list[Path] | None = None) -> Iterator[CleanRecord]:
        for p in shard_paths if shard_paths is not None else self.shard_files():
            yield from self.read_shard(p)
