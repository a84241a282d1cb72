"""ingest → train → shadow_eval → gate on the tiny target, without an orchestrator."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

import pytest

from adaflash.components.gate import gate
from adaflash.components.ingest import NotEnoughData, Snapshot, ingest
from adaflash.components.steps import ar_reference, calibration, prompts_of, shadow_eval
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.lineage import BatchAudit, LineageStore, RecordRow, ShardRow
from adaflash.models.checkpoint import load_drafter_for, save_drafter
from adaflash.serving.offline import DecodeConfig, OfflineDecoder
from adaflash.training.online import OnlineConfig, OnlineTrainer
from adaflash.training.replay import ReplayWindow
from tests.conftest import clean_record, make_bundle, served_record

DOMAINS = ("math", "code")


def serve_into_buffer(target, bundle, gov_dir, n: int, seed: int = 0, max_new: int = 40) -> list[str]:
    """Serve n prompts with `bundle` and store them as governed clean records (one shard each domain)."""
    rng = random.Random(seed)
    tok = target.tokenizer
    prompts, domains = [], []
    for i in range(n):
        dom = DOMAINS[i % 2]
        words = " ".join(
            rng.choice(["add", "sum", "list", "sort", "two", "three", "numbers"]) for _ in range(6)
        )
        prompts.append(tok.chat_prompt(f"{dom}: {words}"))
        domains.append(dom)
    results = OfflineDecoder(target, bundle).generate(prompts, DecodeConfig("dflash", max_new_tokens=max_new))
    clean = []
    for i, (p, r, dom) in enumerate(zip(prompts, results, domains, strict=True)):
        rec = served_record(
            target,
            bundle,
            p,
            r,
            record_id=uuid.UUID(int=rng.getrandbits(128)).hex,
            request_id=str(i),
            tenant_id=f"tenant-{i % 3}",
            domain=dom,
            created_at=datetime(2026, 11, 30, 12, 0, i % 60, tzinfo=UTC),
        )
        clean.append(clean_record(rec, offset=i))
    buffer = ReplayBuffer(gov_dir / "buffer")
    store = LineageStore(gov_dir / "lineage.sqlite")
    shards, rows = [], []
    for tenant in sorted({c.record.tenant_id for c in clean}):
        recs = [c for c in clean if c.record.tenant_id == tenant]
        info = buffer.write_shard(tenant, "2026-11-30", recs)
        shards.append(
            ShardRow(info.shard_id, str(info.path.relative_to(buffer.root)), tenant, info.date, len(recs))
        )
        rows += [
            RecordRow(
                c.record.record_id,
                tenant,
                "clean",
                [],
                info.shard_id,
                "raw",
                0,
                c.provenance.offset,
                0.0,
                None,
            )
            for c in recs
        ]
    now = datetime.now(UTC).isoformat()
    store.commit_batch(BatchAudit(uuid.uuid4().hex, now, now, {}, n, n, 0, 0), rows, shards)
    store.close()
    return [c.record.record_id for c in clean]


@pytest.fixture(scope="module")
def trained(tiny32, tmp_path_factory):
    """A champion (random drafter), traffic it served, and a challenger trained on that traffic."""
    root = tmp_path_factory.mktemp("continual")
    champion = make_bundle(tiny32, block_size=8, seed=1)
    save_drafter(root / "champion", champion.drafter, champion.length_head, champion.meta)
    ids = serve_into_buffer(tiny32, champion, root / "gov", n=48)
    snap = ingest(root / "gov", min_records=32, heldout_per_domain=8)
    snap.save(root / "snapshot")
    cfg = OnlineConfig(epochs=6, lr=2e-3, head_lr=2e-3, random_anchors=16)
    OnlineTrainer(tiny32, load_drafter_for(root / "champion", tiny32), root / "challenger", cfg).train(
        snap.train, lineage={"train_record_ids": snap.lineage["train_record_ids"]}
    )
    return root, ids, Snapshot.load(root / "snapshot"), cfg


def test_ingest_snapshot_names_exact_records_and_refuses_too_little(trained, tmp_path):
    root, ids, snap, _ = trained
    assert len(snap.train) + len(snap.heldout) == len(ids) == snap.lineage["records"]
    assert set(snap.lineage["train_record_ids"]) == {r.record.record_id for r in snap.train}
    assert not set(snap.lineage["train_record_ids"]) & {r.record.record_id for r in snap.heldout}
    assert snap.lineage["tenants"] == ["tenant-0", "tenant-1", "tenant-2"]
    # The held-out count per domain is the configured one, and the lineage says so.
    assert (
        snap.lineage["heldout_by_domain"]
        == {"code": 8, "math": 8}
        == {d: sum(r.record.domain == d for r in snap.heldout) for d in DOMAINS}
    )
    assert snap.lineage["train_by_domain"] == {"code": 16, "math": 16}
    # Never more than half of a domain: every domain still trains on something.
    half = ingest(root / "gov", min_records=32, heldout_per_domain=100)
    assert half.lineage["heldout_by_domain"] == {"code": 12, "math": 12}
    with pytest.raises(NotEnoughData, match="48 new clean records; a run needs at least 100"):
        ingest(root / "gov", min_records=100)


def test_ingest_replays_earlier_records_into_training_only_and_names_them(tiny32, tmp_path):
    bundle = make_bundle(tiny32, block_size=8, seed=1)
    first = set(serve_into_buffer(tiny32, bundle, tmp_path / "gov", n=24, seed=1, max_new=16))
    snap1 = ingest(tmp_path / "gov", min_records=16)
    store = LineageStore(tmp_path / "gov" / "lineage.sqlite")
    store.mark_trained(snap1.shard_ids, "1", "now", snap1.lineage["train_record_ids"])
    store.close()
    second = set(serve_into_buffer(tiny32, bundle, tmp_path / "gov", n=24, seed=2, max_new=16))
    window = ReplayWindow(max_records=10, tenant_cap=0.4)
    snap2 = ingest(tmp_path / "gov", min_records=16, replay=window)
    replayed = set(snap2.lineage["replay_record_ids"])
    # Replay draws only on records an earlier version consumed, bounded and capped per tenant.
    assert len(replayed) == snap2.lineage["replayed_records"] == 10 and replayed <= first
    by_tenant = {t: sum(r.record.tenant_id == t for r in snap2.train if r.record.record_id in replayed)
                 for t in snap2.lineage["tenants"]}  # fmt: skip
    assert max(by_tenant.values()) <= window.per_tenant == 4
    # Replayed records train; the held-out side stays new traffic; the lineage lists both exactly.
    train_ids = {r.record.record_id for r in snap2.train}
    held_ids = {r.record.record_id for r in snap2.heldout}
    assert replayed <= train_ids and held_ids <= second and not held_ids & train_ids
    assert set(snap2.lineage["train_record_ids"]) == train_ids == (second - held_ids) | replayed
    assert snap2.lineage["replay_window"]["max_records"] == 10
    # Without a window, nothing old comes back (the default).
    assert ingest(tmp_path / "gov", min_records=16).lineage["replay_record_ids"] == []


def test_shadow_eval_promotes_a_better_challenger_and_rejects_a_degraded_one(trained, tiny32):
    root, _, snap, cfg = trained
    champ = shadow_eval(tiny32, root / "champion", snap.heldout, concurrency=4, max_new_tokens=40)
    chall = shadow_eval(tiny32, root / "challenger", snap.heldout, concurrency=4, max_new_tokens=40)
    assert champ["lossless"] and chall["lossless"]
    assert set(chall["domains"]) == {"math", "code", "all"}
    for row in chall["domains"].values():
        assert row["calibration_error"] is not None and row["tps"] > 0
        assert row["verified_per_output_token"] > 0
    # Per-record values for the gate's pairing: every held-out record, both τ's.
    assert set(chall["records"]) == {r.record.record_id for r in snap.heldout} == set(champ["records"])
    assert all({"tau", "tau_full", "domain"} <= set(row) for row in chall["records"].values())
    decision = gate(champ, chall)
    assert decision.promote, decision.reasons
    assert decision.interval("tau_full").n == 16 and decision.interval("tau_full").low > 0
    assert chall["domains"]["all"]["tau"] > champ["domains"]["all"]["tau"] * 1.02

    # Degraded: the challenger keeps training on shuffled targets; it must never be promoted over it.
    shuffled = []
    rng = random.Random(0)
    for r in snap.train:
        out = list(r.record.output_token_ids)
        rng.shuffle(out)
        shuffled.append(
            r.model_copy(update={"record": r.record.model_copy(update={"output_token_ids": out})})
        )
    OnlineTrainer(tiny32, load_drafter_for(root / "challenger", tiny32), root / "degraded", cfg).train(
        shuffled
    )
    bad = shadow_eval(tiny32, root / "degraded", snap.heldout, concurrency=4, max_new_tokens=40)
    rejected = gate(chall, bad)
    assert not rejected.promote
    assert rejected.interval("tau_full").gain < 0
    rules = ("the challenger is worse", "not enough evidence", "domain")
    assert any(r.startswith(rules) for r in rejected.reasons), rejected.reasons


def test_per_record_replay_pools_to_the_domain_replay(trained, tiny32):
    """shadow_eval pools each record's replayed rounds; the sums equal evaluate_acceptance's walk."""
    from adaflash.training.blocks import sequence_pass
    from adaflash.training.evaluate import evaluate_acceptance

    root, _, snap, _ = trained
    bundle = load_drafter_for(root / "challenger", tiny32)
    held = snap.heldout
    ref = ar_reference(tiny32, prompts_of(held), 4, 40)
    per = calibration(tiny32, bundle, held, ref)
    seqs = [r.record.prompt_token_ids + ref[r.record.record_id] for r in held]
    ids = bundle.drafter.config.target_layer_ids
    passes = [p for i in range(0, len(seqs), 8) for p in sequence_pass(tiny32.model, seqs[i : i + 8], ids)]
    starts = [len(r.record.prompt_token_ids) for r in held]
    domains = [r.record.domain for r in held]
    pooled = evaluate_acceptance(bundle.drafter, tiny32.model, passes, starts, domains, bundle.length_head)
    for dom in ("all", *DOMAINS):
        rows = [p for p, r in zip(per, held, strict=True) if dom == "all" or r.record.domain == dom]
        full = sum(p.full_tokens for p in rows) / sum(p.full_rounds for p in rows)
        assert full == pytest.approx(pooled[dom]["dflash_tau"], abs=1e-4)
        mae = sum(p.head_abs_err for p in rows) / sum(p.head_rounds for p in rows)
        assert mae == pytest.approx(pooled[dom]["length_head_mae"], abs=1e-4)
