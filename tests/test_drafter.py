"""Drafter: the public DFlash format (interop with the reference package), save/load checks."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.errors import CheckpointError
from adaflash.models.checkpoint import load_drafter, save_drafter
from tests.conftest import ar_reference, make_bundle


def _perturb(module, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


@pytest.mark.parametrize("layers,block", [(1, 4), (2, 16)])
def test_saved_drafter_loads_in_reference_dflash_and_matches(tmp_path, tiny32, layers, block):
    from dflash.model import DFlashDraftModel

    b = make_bundle(tiny32, num_layers=layers, block_size=block)
    _perturb(b.drafter)  # norms away from 1 so every weight matters
    save_drafter(tmp_path / "d", b.drafter, b.length_head, b.meta)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == block
    assert set(cfg["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    ref = DFlashDraftModel.from_pretrained(str(tmp_path / "d")).eval()
    assert list(ref.target_layer_ids) == list(b.config.target_layer_ids)
    assert ref.block_size == block and ref.mask_token_id == tiny32.mask_token_id

    S = 21
    n_feat = len(b.config.target_layer_ids) * tiny32.config.hidden_size
    feats = torch.randn(2, S, n_feat) * 3
    block_ids = torch.full((2, block), tiny32.mask_token_id)
    block_ids[:, 0] = torch.tensor([65, 97])
    emb = tiny32.model.embed(block_ids)
    pos = torch.arange(S + block)[None].expand(2, -1)
    with torch.no_grad():
        theirs = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats)
        kv = b.drafter.context_kv(feats, pos[:, :S])
        ours = b.drafter(emb, pos[:, S:], kv, torch.ones(2, block, S, dtype=torch.bool))
        # The incremental path (what decoding uses) gives the same states.
        ctx = b.drafter.new_context(2, 64)
        b.drafter.extend_context(ctx, feats[:, :10], torch.tensor([10, 10]))
        b.drafter.extend_context(ctx, feats[:, 10:], torch.tensor([S - 10, S - 10]))
        incremental = b.drafter.draft_hidden(ctx, emb)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    torch.testing.assert_close(incremental, theirs, rtol=0, atol=1e-5)
    # Logits go through the shared LM head (embedding norm ~8 here), which scales the 1e-6 gaps.
    logits_ref = ref.compute_logits(theirs, tiny32.model.lm_head)
    torch.testing.assert_close(tiny32.model.logits(ours), logits_ref, rtol=1e-5, atol=1e-4)


def test_roundtrip_keeps_weights_head_and_meta(tmp_path, tiny32):
    b = make_bundle(tiny32)
    _perturb(b.length_head)
    b.meta.lineage = {"kind": "test", "records": 3}
    save_drafter(tmp_path / "d", b.drafter, b.length_head, b.meta)
    files = {p.name for p in (tmp_path / "d").iterdir()}
    assert files == {"config.json", "model.safetensors", "length_head.safetensors", "adaflash.json"}
    got = load_drafter(
        tmp_path / "d",
        target_fingerprint=tiny32.fingerprint,
        target_hidden_size=64,
        target_vocab_size=320,
        target_num_layers=4,
    )
    for (k, v), (k2, v2) in zip(
        b.drafter.state_dict().items(), got.drafter.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2)
    h = torch.randn(3, 8, 64)
    torch.testing.assert_close(got.length_head(h), b.length_head(h))
    assert got.meta.lineage == {"kind": "test", "records": 3}
    # The DFlash weights file carries no length-head tensors (SGLang would drop them silently).
    from safetensors.torch import load_file

    assert not any(
        "proj.weight" in k and "layers" not in k for k in load_file(str(tmp_path / "d/model.safetensors"))
    )


def test_rejects_mismatched_or_corrupt_checkpoints(tmp_path, tiny32):
    b = make_bundle(tiny32)
    d = tmp_path / "d"
    save_drafter(d, b.drafter, b.length_head, b.meta)
    with pytest.raises(CheckpointError, match="trained for target"):
        load_drafter(d, target_fingerprint="0123456789abcdef")
    with pytest.raises(CheckpointError, match="hidden size 64 != target's 576"):
        load_drafter(d, target_hidden_size=576)
    with pytest.raises(CheckpointError, match="vocab size"):
        load_drafter(d, target_vocab_size=49152)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nope")
    (d / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_drafter(d)
    save_drafter(d, b.drafter, b.length_head, b.meta)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_drafter(d)
    save_drafter(d, b.drafter, b.length_head, b.meta)
    (d / "adaflash.json").unlink()
    with pytest.raises(CheckpointError, match="missing adaflash.json"):
        load_drafter(d)


def test_draft_vocabulary_round_trips_and_limits_proposals_losslessly(tmp_path, tiny64):
    from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request

    b = make_bundle(tiny64, block_size=4, seed=3)
    vocab = torch.arange(0, tiny64.config.vocab_size, 3)  # every third token may be proposed
    d = save_drafter(tmp_path / "d", b.drafter, b.length_head, b.meta, draft_vocab=vocab)
    loaded = load_drafter(d, dtype=tiny64.model.dtype)
    assert torch.equal(loaded.draft_vocab, vocab)
    prompts = [[256, *f"v{i}: {'ab' * i}".encode()] for i in range(6)]
    ref = ar_reference(tiny64, prompts, 24)
    for temperature in (0.0, 0.8):
        engine = Engine(tiny64, loaded, EngineConfig(method="dflash", max_running=4), "v1")
        plans = []

        def spy(*args, plan=engine.policy.plan, plans=plans, **kwargs):
            plans.append(plan(*args, **kwargs))
            return plans[-1]

        engine.policy.plan = spy
        params = GenParams(max_tokens=24, temperature=temperature, seed=1)
        reqs = [engine.submit(Request(p, params)) for p in prompts]
        engine.run_until_idle()
        drafted = torch.cat([p.drafts for p in plans])
        assert drafted.numel() > 50 and bool(torch.isin(drafted, vocab).all())
        if temperature == 0:
            assert [r.output_ids for r in reqs] == ref
    (d / "draft_vocab.json").write_text(json.dumps({"token_ids": [5, 3]}))
    with pytest.raises(CheckpointError, match="sorted, distinct"):
        load_drafter(d)
    (d / "draft_vocab.json").write_text(json.dumps({"token_ids": [0, tiny64.config.vocab_size]}))
    with pytest.raises(CheckpointError, match="sorted, distinct"):
        load_drafter(d)


def test_drafter_context_projects_lazily_per_slot_and_equals_the_eager_cache(tiny32):
    """`DrafterSlots` queues committed rows per slot and projects a slot only when it drafts (or
    the queue's byte cap is reached). Whatever the order, the cache a draft reads equals the one
    projecting every row at once would build: reused slots and rewritten positions included."""
    import torch

    from adaflash.serving.runner import DrafterSlots

    drafter = make_bundle(tiny32, block_size=4, seed=3).drafter
    width = len(drafter.config.target_layer_ids) * tiny32.config.hidden_size
    gen = torch.Generator().manual_seed(0)

    def rows(slot: int, start: int, n: int):
        return torch.randn(n, width, generator=gen), torch.full((n,), slot), torch.arange(start, start + n)

    # slot 0: prefill 5, commit 2; slot 1: prefill 3; slot 0's positions 5..6 rewritten (a later
    # round); slot 1 reused by a new request (prefill from 0 again, shorter than the old one).
    writes = [rows(0, 0, 5) + rows(1, 0, 3), rows(0, 5, 2), rows(0, 5, 3), rows(1, 0, 2)]
    lazy = DrafterSlots(drafter, 2, 16)
    eager = DrafterSlots(drafter, 2, 16, flush_bytes=1)  # every extend projects at once
    for w in writes:
        if len(w) == 6:  # two segments in one step, as the engine commits them
            f, s, p = (torch.cat([w[i], w[i + 3]]) for i in range(3))
        else:
            f, s, p = w
        lazy.extend(f, s, p)
        eager.extend(f, s, p)
    assert lazy.queued_rows == 5 + 2 + 3 + 2  # slot 1's first occupant's 3 rows were dropped as stale
    lazy.flush([0])  # slot 0 drafts: only its rows are projected
    assert lazy.queued_rows == 2 and not any(k[1].any() for k in lazy.k)
    for k_lazy, k_eager in zip(lazy.k, eager.k, strict=True):
        assert torch.equal(k_lazy[0, :, :8], k_eager[0, :, :8])
    lazy.flush()
    for a, b in zip(lazy.k + lazy.v, eager.k + eager.v, strict=True):  # what each slot's length shows
        assert torch.equal(a[0, :, :8], b[0, :, :8]) and torch.equal(a[1, :, :2], b[1, :, :2])
    # The byte cap: a queue past it projects everything without waiting for a draft.
    capped = DrafterSlots(drafter, 2, 16, flush_bytes=4 * width * 4)
    capped.extend(*rows(0, 0, 3))
    assert capped.queued_rows == 3
    capped.extend(*rows(1, 0, 1))
    assert capped.queued_rows == 0


def test_past_the_bound_a_cost_policy_slot_loses_its_queue_instead_of_projecting_it(tiny32):
    """A C = 32 prefill wave that never drafts must not pay the drafter's projection: past the
    byte bound the longest droppable queue is dropped and its slot marked lost (it cannot draft,
    and later rows of the same occupant are not queued); a new occupant starts whole again.
    Slots that are not droppable (a method that drafts every round) are still projected."""
    import pytest
    import torch

    from adaflash.serving.runner import DrafterSlots

    drafter = make_bundle(tiny32, block_size=4, seed=3).drafter
    width = len(drafter.config.target_layer_ids) * tiny32.config.hidden_size

    def rows(slot: int, start: int, n: int):
        return torch.randn(n, width), torch.full((n,), slot), torch.arange(start, start + n)

    slots = DrafterSlots(drafter, 3, 16, flush_bytes=8 * width * 4)
    slots.set_droppable(1, True)
    slots.set_droppable(2, True)
    slots.extend(*rows(0, 0, 2))
    slots.extend(*rows(2, 0, 1))
    slots.extend(*rows(1, 0, 6))  # 9 rows past an 8-row bound: slot 1, the longest droppable, goes
    assert slots.lost == {1} and slots.dropped_rows == 6 and slots.queued_rows == 3  # under half: 2 stays
    assert not any(k.any() for k in slots.k)  # nothing was projected
    slots.extend(*rows(1, 6, 1))  # the same occupant's next commit: its context has a hole
    assert slots.queued_rows == 3
    with pytest.raises(RuntimeError, match="dropped"):
        slots.draft_hidden(torch.tensor([1]), torch.tensor([7]), torch.zeros(1, 4, tiny32.config.hidden_size))
    slots.extend(*rows(1, 0, 2))  # a new occupant's prefill
    assert slots.lost == set() and slots.queued_rows == 5
    # Past the bound with only slot 0 (not droppable) left to free: everything is projected.
    slots.set_droppable(1, False)
    slots.set_droppable(2, False)
    slots.extend(*rows(0, 2, 3))
    assert slots.queued_rows == 0 and slots.lost == set() and all(k[0, :, :4].any() for k in slots.k)
