"""ingest → train → shadow_eval → gate on the tiny target, without an orchestrator."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

import pytest

from adaflash.components.steps import GatePolicy, NotEnoughData, Snapshot, gate, ingest, shadow_eval
from adaflash.feedback.schema import CleanRecord, FeedbackRecord, Provenance, RoundRecord
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.lineage import BatchAudit, LineageStore, RecordRow, ShardRow
from adaflash.models.checkpoint import load_drafter_for, save_drafter
from adaflash.serving.offline import DecodeConfig, OfflineDecoder
from adaflash.training.online import OnlineConfig, OnlineTrainer
from tests.conftest import make_bundle

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
        rounds, start = [], 0
        for rd in r.rounds:
            rounds.append(RoundRecord(start=start, verify_len=rd.verify_len, accepted=rd.accepted))
            start += rd.accepted + 1
        rec = FeedbackRecord(
            record_id=uuid.UUID(int=rng.getrandbits(128)).hex,
            request_id=str(i),
            tenant_id=f"tenant-{i % 3}",
            domain=dom,
            created_at=datetime(2026, 11, 30, 12, 0, i % 60, tzinfo=UTC),
            target_fingerprint=target.fingerprint,
            method="dflash",
            block_size=bundle.drafter.block_size,
            prompt_text=tok.decode(p),
            output_text=tok.decode(r.token_ids),
            prompt_token_ids=p,
            output_token_ids=r.token_ids,
            rounds=rounds,
        )
        prov = Provenance(topic="adaflash.feedback.raw", partition=0, offset=i, governed_at=datetime.now(UTC))
        clean.append(CleanRecord(record=rec, provenance=prov))
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
    snap = ingest(root / "gov", min_records=32, heldout_fraction=0.25)
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
    with pytest.raises(NotEnoughData, match="48 new clean records; a run needs at least 100"):
        ingest(root / "gov", min_records=100)


def test_shadow_eval_promotes_a_better_challenger_and_rejects_a_degraded_one(trained, tiny32):
    root, _, snap, cfg = trained
    champ = shadow_eval(tiny32, root / "champion", snap.heldout, concurrency=4, max_new_tokens=40)
    chall = shadow_eval(tiny32, root / "challenger", snap.heldout, concurrency=4, max_new_tokens=40)
    assert champ["lossless"] and chall["lossless"]
    assert set(chall["domains"]) == {"math", "code", "all"}
    for row in chall["domains"].values():
        assert row["calibration_error"] is not None and row["tps"] > 0
        assert row["verified_per_output_token"] > 0
    decision = gate(champ, chall, GatePolicy(min_gain=0.02))
    assert decision.promote, decision.reasons
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
    assert any("does not beat" in r or "regresses" in r for r in rejected.reasons)


def _report(all_full, all_tau, domains, lossless=True):
    rows = {"all": {"n": sum(n for n, _, _ in domains.values()), "tau_full": all_full, "tau": all_tau}}
    rows.update({d: {"n": n, "tau_full": full, "tau": tau} for d, (n, full, tau) in domains.items()})
    return {"lossless": lossless, "domains": rows}


def test_gate_on_full_block_tau_guards_served_tau_and_ignores_tiny_domains():
    champ = _report(1.05, 1.0, {"code": (6, 1.05, 1.0), "chat": (3, 1.05, 1.0)})
    # Served τ equal (k̂ = 1 for both), full-block τ +5%: promoted. A 3-record domain's dip cannot veto.
    better = _report(1.10, 1.0, {"code": (6, 1.12, 1.0), "chat": (3, 1.00, 1.0)})
    assert gate(champ, better).promote
    # The same dip in a domain with enough held-out records vetoes it.
    champ6 = _report(1.05, 1.0, {"code": (6, 1.05, 1.0), "chat": (6, 1.05, 1.0)})
    veto = gate(champ6, _report(1.10, 1.0, {"code": (6, 1.12, 1.0), "chat": (6, 1.00, 1.0)}))
    assert not veto.promote and any("chat: tau_full" in r for r in veto.reasons)
    # A better drafter whose served τ drops (the head verifies worse) is not promoted.
    served = gate(champ, _report(1.10, 0.95, {"code": (6, 1.12, 0.95), "chat": (3, 1.1, 1.0)}))
    assert not served.promote and any("domain all: tau 0.950" in r for r in served.reasons)
    # Not lossless: never.
    assert not gate(champ, _report(1.5, 1.2, {"code": (6, 1.5, 1.2)}, lossless=False)).promote
    # Gating on served τ instead: equal served τ does not beat the champion.
    assert not gate(champ, better, GatePolicy(metric="tau")).promote
