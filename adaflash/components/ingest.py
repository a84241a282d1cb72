"""The pipeline's first step: clean records not yet trained on → a snapshot (train + held-out
split) with its lineage. Read by `components/steps.py` (the other steps) and the KFP wrapper.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.feedback.schema import CleanRecord
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.config import GovernanceConfig
from adaflash.governance.lineage import LineageStore
from adaflash.training.replay import ReplayWindow, replay_sample

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """What one pipeline run trains and evaluates on, and exactly where it came from."""

    train: list[CleanRecord]
    heldout: list[CleanRecord]
    shard_ids: list[str]
    lineage: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        for name, recs in (("train", self.train), ("heldout", self.heldout)):
            (path / f"{name}.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in recs))
        (path / "lineage.json").write_text(
            json.dumps({"shard_ids": self.shard_ids, **self.lineage}, indent=2)
        )

    def summary(self) -> dict:
        return {"records": self.lineage["records"], "shards": len(self.shard_ids),
                "tenants": len(self.lineage["tenants"])}  # fmt: skip

    @classmethod
    def load(cls, path: Path) -> Snapshot:
        def read(name: str) -> list[CleanRecord]:
            lines = (path / f"{name}.jsonl").read_text().splitlines()
            return [CleanRecord.model_validate_json(x) for x in lines if x]

        lineage = json.loads((path / "lineage.json").read_text())
        return cls(read("train"), read("heldout"), lineage.pop("shard_ids"), lineage)


class NotEnoughData(AdaFlashError):
    """Fewer new clean records than a training run needs."""


def ingest(
    governance_dir: Path,
    min_records: int = 128,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    heldout_per_domain: int = 0,
    replay: ReplayWindow | None = None,
) -> Snapshot:
    """Every clean shard no drafter version has trained on; records split by a seeded shuffle;
    plus, with a `replay` window, earlier clean records (from shards a version already trained
    on) added to the training side: recency-weighted, capped per tenant (`training/replay.py`).

    Held-out records are as recent as the training ones and never trained on, so the shadow
    evaluation sees the traffic the fleet is serving now. `heldout_per_domain` > 0 holds out that
    many records of each domain (at most half of a domain's records, so each still trains on
    some) instead of `heldout_fraction` of all: the gate's evidence per domain is then a stated
    count, not whatever share of a small domain a fraction happens to give.
    """
    replay = replay or ReplayWindow()
    layout = GovernanceConfig(governance_dir)
    store = LineageStore(layout.lineage_path)
    try:
        shards = store.untrained_shards()
        earlier = store.trained_shards() if replay.max_records else []
    finally:
        store.close()
    buffer = ReplayBuffer(layout.buffer_dir)
    new = _read_shards(buffer, shards)
    records, shards = new.records, [s for s in shards if s["shard_id"] not in new.skipped_shards]
    if len(records) < min_records:
        raise NotEnoughData(f"{len(records)} new clean records; a run needs at least {min_records}")
    records.sort(key=lambda r: r.record.record_id)
    random.Random(seed).shuffle(records)
    if heldout_per_domain > 0:
        by_domain: dict[str, list[CleanRecord]] = defaultdict(list)
        for r in records:
            by_domain[r.record.domain or "unknown"].append(r)
        held_ids = {r.record.record_id for recs in by_domain.values()
                    for r in recs[: min(heldout_per_domain, len(recs) // 2)]}  # fmt: skip
        heldout = [r for r in records if r.record.record_id in held_ids]
        train = [r for r in records if r.record.record_id not in held_ids]
    else:
        n_held = max(1, int(len(records) * heldout_fraction))
        heldout, train = records[:n_held], records[n_held:]
    # Replayed records only ever train: the held-out side stays new traffic no version has seen.
    old = _read_shards(buffer, earlier).records
    replayed = replay_sample(old, replay, seed, exclude={r.record.record_id for r in records})
    train = train + replayed
    tenants = sorted({r.record.tenant_id for r in records})
    offsets: dict[str, list[int]] = {}
    for r in records:
        key = f"{r.provenance.topic}/{r.provenance.partition}"
        lo, hi = offsets.get(key, [r.provenance.offset, r.provenance.offset])
        offsets[key] = [min(lo, r.provenance.offset), max(hi, r.provenance.offset)]
    lineage = {
        "records": len(records),
        "train_records": len(train),
        "heldout_records": len(heldout),
        "replayed_records": len(replayed),
        "heldout_by_domain": _count_domains(heldout),
        "train_by_domain": _count_domains(train),
        "train_record_ids": sorted(r.record.record_id for r in train),
        "replay_record_ids": [r.record.record_id for r in replayed],
        "replay_window": asdict(replay),
        "tenants": tenants,
        "offsets": offsets,
        "skipped_shards": new.skipped_shards,
        "skipped_records": new.skipped_records,
        "ingested_at": time.time(),
    }
    return Snapshot(train, heldout, [s["shard_id"] for s in shards], lineage)


@dataclass
class _ShardsRead:
    records: list[CleanRecord] = field(default_factory=list)
    skipped_shards: list[str] = field(default_factory=list)  # files that could not be read at all
    skipped_records: int = 0  # their records (as the lineage store counts them) and bad rows


def _read_shards(buffer: ReplayBuffer, shards: list[dict]) -> _ShardsRead:
    """Every record that reads back. An unreadable shard is skipped with a logged reason and
    counted, not raised: it stays untrained, so raising would fail `ingest` on every later run
    (issue 32). A skipped file stays out of the snapshot's shard ids, so no version claims to have
    trained on it."""
    out = _ShardsRead()
    for s in shards:
        got = buffer.read_shard_tolerant(buffer.root / s["path"])
        if got.error is not None:
            log.warning("ingest: shard %s is unreadable, skipped (%s)", s["shard_id"], got.error)
            out.skipped_shards.append(s["shard_id"])
            out.skipped_records += s["n_records"]
            continue
        if got.bad_rows:
            log.warning(
                "ingest: %d record(s) of shard %s do not validate, skipped", got.bad_rows, s["shard_id"]
            )
            out.skipped_records += got.bad_rows
        out.records.extend(got.records)
    return out


def _count_domains(records: list[CleanRecord]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for r in records:
        out[r.record.domain or "unknown"] += 1
    return dict(sorted(out.items()))
