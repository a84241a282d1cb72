"""OPD / OSD / FKL objective and the online trainer on served (tiny) traffic."""

from __future__ import annotations

import math

import pytest
import torch

from adaflash.feedback.schema import CleanRecord
from adaflash.models.checkpoint import load_drafter_for
from adaflash.serving.offline import DecodeConfig, OfflineDecoder
from adaflash.training.blocks import sequence_pass
from adaflash.training.losses import drafter_loss, position_weights
from adaflash.training.objective import Objective, block_objective
from adaflash.training.online import OnlineConfig, OnlineTrainer
from tests.conftest import clean_record, make_bundle, served_record


def test_opd_loss_matches_hand_computation_with_per_entry_clipping():
    q = [0.7, 0.2, 0.1]
    p = [0.2, 0.5, 0.3]
    logits = torch.tensor([q]).log()
    teacher = torch.tensor([p]).log()
    alpha, delta = 0.8, 0.01
    terms = [qi * math.log(qi / pi) for qi, pi in zip(q, p, strict=True)]  # 0.877, -0.183, -0.110
    per_entry = sum(min(t, delta) for t in terms)  # -0.2831: only the first entry is clipped
    global_clip = min(sum(terms), delta)  # 0.01: clipping the sum would be a different loss
    assert abs(per_entry - global_clip) > 0.2
    ce = -math.log(q[1])  # x* = the teacher's top-1 = token 1
    expected = alpha * ce + (1 - alpha) * per_entry  # 1.2309
    got = drafter_loss("opd", logits, teacher, alpha, delta)
    assert got.item() == pytest.approx(expected, abs=1e-5)
    # α and δ are honoured
    assert drafter_loss("opd", logits, teacher, 1.0, delta).item() == pytest.approx(ce, abs=1e-5)
    no_clip = alpha * ce + (1 - alpha) * sum(terms)
    assert drafter_loss("opd", logits, teacher, alpha, 10.0).item() == pytest.approx(no_clip, abs=1e-5)
    fkl = sum(pi * math.log(pi / qi) for qi, pi in zip(q, p, strict=True))
    assert drafter_loss("fkl", logits, teacher, 0.0).item() == pytest.approx(fkl, abs=1e-5)


def _served_records(target, bundle, n=6, max_new=40, method="dflash") -> list[CleanRecord]:
    """Serve prompts with the speculative decoder and turn the results into clean feedback."""
    tok = target.tokenizer
    prompts = [tok.chat_prompt(f"count to {i} and explain why numbers matter") for i in range(n)]
    results = OfflineDecoder(target, bundle).generate(prompts, DecodeConfig(method, max_new_tokens=max_new))
    out = []
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        ids = {"request_id": f"r{i}", "tenant_id": "t", "drafter_version": "1"}
        out.append(clean_record(served_record(target, bundle, p, r, method, **ids), offset=i, topic="t"))
    return out


def _served_pass(target):
    """A drafter, and one served sequence's target pass with teacher rows for its last 20 tokens."""
    bundle = make_bundle(target, block_size=8)
    rec = _served_records(target, bundle, n=1)[0]
    seq = rec.record.prompt_token_ids + rec.record.output_token_ids
    ids = bundle.drafter.config.target_layer_ids
    return bundle, seq, sequence_pass(target.model, [seq], ids, teacher_from=[len(seq) - 20])[0]


def test_length_head_loss_never_reaches_the_drafter(tiny32):
    bundle, seq, sp = _served_pass(tiny32)
    anchors = torch.arange(len(seq) - 20, len(seq) - 8, 3)
    out = block_objective(
        bundle.drafter, bundle.length_head, tiny32.model, sp, anchors, Objective(), position_weights(8, None)
    )
    out.head.backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in bundle.drafter.parameters())
    assert any(p.grad is not None and p.grad.any() for p in bundle.length_head.parameters())
    bundle.length_head.zero_grad()
    out.drafter.backward()
    assert all(p.grad is None or not p.grad.any() for p in bundle.length_head.parameters())
    assert any(p.grad is not None and p.grad.any() for p in bundle.drafter.parameters())


def test_osd_trains_only_on_rejected_positions(tiny32):
    bundle, seq, sp = _served_pass(tiny32)
    anchors = torch.tensor([len(seq) - 20, len(seq) - 15])
    w = position_weights(8, None)
    args = (bundle.drafter, bundle.length_head, tiny32.model, sp, anchors, Objective("osd"), w)
    assert block_objective(*args, torch.tensor([7, 7])).rows == 0  # everything accepted: nothing to learn
    assert block_objective(*args, torch.tensor([2, 0])).rows == 5 + 7
    assert block_objective(*args, torch.tensor([-1, -1])).rows == 14  # no served round: every position
    assert block_objective(*args[:-2], Objective("opd"), w).rows == 14


def test_online_trainer_improves_acceptance_resumes_and_saves_a_loadable_drafter(tiny32, tmp_path):
    torch.manual_seed(0)
    bundle = make_bundle(tiny32, block_size=8, seed=3)
    records = _served_records(tiny32, bundle, n=6, max_new=48)
    assert all(r.record.rounds for r in records)
    cfg = OnlineConfig(epochs=4, lr=2e-3, head_lr=2e-3, random_anchors=8)
    out = tmp_path / "challenger"

    class Stop(Exception):
        pass

    def interrupt(kind, info):
        if kind == "step" and info["epoch"] == 2 and info["record"] == 3:
            raise Stop

    with pytest.raises(Stop):
        OnlineTrainer(tiny32, bundle, out, cfg, progress=interrupt).train(records)
    fresh = make_bundle(tiny32, block_size=8, seed=3)  # the same champion, reloaded
    fresh.draft_vocab = torch.arange(0, 300)  # a champion drafting over part of the vocabulary
    seen = []
    metrics = OnlineTrainer(tiny32, fresh, out, cfg, progress=lambda k, i: seen.append((k, i))).train(
        records, lineage={"record_ids": [r.record.record_id for r in records]}
    )
    assert seen[0] == ("resume", {"epoch": 2, "cursor": 0})  # from the state saved at the last epoch end
    taus = [e["train_tau"] for e in metrics["epochs"]]
    assert len(taus) == 4 and taus[-1] > taus[0]
    loaded = load_drafter_for(out, tiny32)
    assert loaded.meta.lineage["loss"] == "opd" and len(loaded.meta.lineage["record_ids"]) == 6
    assert torch.equal(loaded.draft_vocab, fresh.draft_vocab)  # the challenger keeps its parent's
    # the trained drafter still decodes losslessly
    ar = OfflineDecoder(tiny32, None).generate([records[0].record.prompt_token_ids], DecodeConfig("ar", 24))
    sd = OfflineDecoder(tiny32, loaded).generate(
        [records[0].record.prompt_token_ids], DecodeConfig("adaflash", 24)
    )
    assert ar[0].token_ids == sd[0].token_ids


def test_length_head_learns_only_from_held_out_labels(tiny32, tmp_path):
    """After its first pass over a record the drafter has fitted it, so later epochs' acceptance
    (and any replayed record's) is in-sample: the head must not learn from it, while the drafter
    keeps training. With head_labels="all" it does, so this test can fail."""
    bundle = make_bundle(tiny32, block_size=8, seed=5)
    records = _served_records(tiny32, bundle, n=4, max_new=32)
    replayed = [records[0].record.record_id, records[1].record.record_id]

    def train(name: str, **kw) -> tuple[dict, dict, dict]:
        champion = make_bundle(tiny32, block_size=8, seed=5)
        cfg = OnlineConfig(lr=2e-3, head_lr=2e-3, **kw)
        metrics = OnlineTrainer(tiny32, champion, tmp_path / name, cfg).train(records, replayed=replayed)
        heads = {k: v.clone() for k, v in champion.length_head.state_dict().items()}
        return heads, {k: v.clone() for k, v in champion.drafter.state_dict().items()}, metrics

    head1, drafter1, m1 = train("one", epochs=1)
    head2, drafter2, m2 = train("two", epochs=2)
    # Epoch 2 moves the drafter but leaves the head exactly where epoch 1 left it.
    assert all(torch.equal(head1[k], head2[k]) for k in head1)
    assert any(not torch.equal(drafter1[k], drafter2[k]) for k in drafter1)
    # Only the two new records' blocks labelled the head, and only in the first epoch.
    new_blocks = m1["epochs"][0]["head_blocks"]
    assert 0 < new_blocks < m1["epochs"][0]["blocks"]
    assert m2["epochs"][1]["head_blocks"] == 0

    head_all, _, m_all = train("all", epochs=2, head_labels="all")
    assert m_all["epochs"][1]["head_blocks"] == m_all["epochs"][1]["blocks"]
    assert any(not torch.equal(head2[k], head_all[k]) for k in head2)

    # Every record replayed: the head keeps its champion's weights.
    champion = make_bundle(tiny32, block_size=8, seed=5)
    before = {k: v.clone() for k, v in champion.length_head.state_dict().items()}
    ids = [r.record.record_id for r in records]
    OnlineTrainer(tiny32, champion, tmp_path / "replay", OnlineConfig(lr=2e-3, head_lr=2e-3)).train(
        records, replayed=ids
    )
    assert all(torch.equal(before[k], v) for k, v in champion.length_head.state_dict().items())
