"""The serving engine: packed steps verify exactly Σk̂_i tokens, every method is lossless under
continuous batching (greedy token-identical, sampling distribution-identical), the scheduler's
admission/queue/cancellation, and hot reload between steps."""

from __future__ import annotations

import shutil

import pytest
import torch

from adaflash.errors import CheckpointError, InputError
from adaflash.models.checkpoint import save_drafter
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.reload import DrafterReloader
from adaflash.serving.scheduler import QueueFull
from tests.conftest import ar_reference, make_bundle
from tests.test_speculative import (
    _chi2_pvalue,
    _exact_law,
    _flat_drafter,
    _tiny_vocab_target,
    engine_sample_counts,
    quick_train,
)

PROMPTS = [[256, *f"q{i}: {'ab' * (i % 5)} {i * 7}?".encode()] for i in range(24)]


@pytest.fixture(scope="module")
def trained(tiny64):
    """A drafter that accepts zero, some and all of its drafts on the tiny target."""
    return quick_train(make_bundle(tiny64, block_size=8, seed=4), tiny64, 40, seed=4)


@pytest.fixture(scope="module")
def ar_ref(tiny64):
    return ar_reference(tiny64, PROMPTS, 40)


def _run(engine: Engine, prompts, max_tokens=40, method=None, stagger=0):
    """Submit `stagger` requests per step after the first batch (continuous arrivals)."""
    reqs = [Request(p, GenParams(max_tokens=max_tokens, temperature=0.0, method=method)) for p in prompts]
    first = len(reqs) if not stagger else stagger
    for r in reqs[:first]:
        engine.submit(r)
    rest = reqs[first:]
    while engine.step() is not None or rest:
        for r in rest[:stagger]:
            engine.submit(r)
        rest = rest[stagger:]
    return reqs


def test_step_verifies_exactly_sum_of_khat(tiny64):
    bundle = quick_train(make_bundle(tiny64, block_size=8, seed=4), tiny64, 40, seed=4)
    with torch.no_grad():  # an untrained head is nearly constant: sharpen it so k̂ varies by request
        bundle.length_head.out.weight.mul_(40)
    engine = Engine(tiny64, bundle, EngineConfig(method="adaflash"), "v1")
    rows_seen: list[int] = []
    # The linear layers of the target see exactly the packed rows: count them at an MLP input.
    hook = tiny64.model.layers[0].mlp.register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    try:
        for p in PROMPTS[:12]:
            engine.submit(Request(p, GenParams(max_tokens=40, temperature=0)))
        checked = 0
        while (stats := engine.step()) is not None:
            if stats.admitted:
                assert rows_seen[-1] == stats.prefill_tokens + stats.verify_tokens
                continue
            k = engine.block_size
            assert rows_seen[-1] == stats.target_rows == stats.verify_tokens == sum(stats.verify_lens)
            assert all(1 <= kh <= k for kh in stats.verify_lens)
            if len(set(stats.verify_lens)) > 1:  # ragged: no padding to k or to max k̂
                checked += 1
                assert stats.verify_tokens < max(stats.verify_lens) * stats.running
    finally:
        hook.remove()
    assert checked > 5


@pytest.mark.parametrize("method", ["ar", "dflash", "adaflash"])
def test_lossless_under_continuous_batching(tiny64, trained, ar_ref, method):
    engine = Engine(tiny64, trained, EngineConfig(method=method, max_running=8), "v1")
    reqs = _run(engine, PROMPTS, stagger=3)
    assert [r.output_ids for r in reqs] == ar_ref
    rounds = [rd for r in reqs for rd in r.rounds]
    for r in reqs:  # feedback's Round convention: start = output index of the anchor
        for a, b in zip(r.rounds, r.rounds[1:], strict=False):
            assert b.start == a.start + a.accepted + 1
        assert r.rounds[0].start == 0
    if method != "ar":
        assert any(rd.accepted == rd.verify_len - 1 > 0 for rd in rounds)  # full blocks accepted
        assert any(rd.accepted == 0 and rd.verify_len > 1 for rd in rounds)  # and rejected ones
    if method == "adaflash":
        assert len({rd.verify_len for rd in rounds}) > 2 and all(rd.a_hat is not None for rd in rounds)


def test_mixed_methods_share_steps(tiny64, trained, ar_ref):
    engine = Engine(tiny64, trained, EngineConfig(max_running=32), "v1")
    methods = ["ar", "dflash", "adaflash"]
    reqs = [
        engine.submit(Request(p, GenParams(max_tokens=40, temperature=0, method=methods[i % 3])))
        for i, p in enumerate(PROMPTS)
    ]
    engine.run_until_idle()
    assert [r.output_ids for r in reqs] == ar_ref
    assert {r.method for r in reqs} == set(methods)


def test_sampling_matches_target_distribution():
    target = _tiny_vocab_target()
    bundle = _flat_drafter(target)
    prompt, n, temperature = [0, 1, 2], 3, 1.0
    counts, rounds, reqs = engine_sample_counts(target, bundle, "dflash", prompt, n, temperature, 6000)
    assert (
        sum(rd.accepted for rd in rounds) > 500
        and sum(rd.verify_len - 1 - rd.accepted for rd in rounds) > 500
    )
    assert _chi2_pvalue(counts, _exact_law(target, prompt, n, temperature)) > 1e-3
    # A request's sample depends on its seed only, not on who shared its steps.
    again = Engine(target, bundle, EngineConfig(method="dflash", max_running=1, max_model_len=16))
    solo = [
        again.submit(Request(prompt, GenParams(max_tokens=n, temperature=temperature, seed=i)))
        for i in range(5)
    ]
    again.run_until_idle()
    assert [r.output_ids for r in solo] == [r.output_ids for r in reqs[:5]]


def test_ema_admission_queue_bound_and_cancellation(tiny64, trained):
    engine = Engine(
        tiny64,
        trained,
        EngineConfig(method="dflash", max_running=4, max_queue=3, step_token_budget=12, beta=0.5),
        "v1",
    )
    sched = engine.scheduler
    reqs = [engine.submit(Request(p, GenParams(max_tokens=30, temperature=0))) for p in PROMPTS[:3]]
    with pytest.raises(QueueFull) as full:
        engine.submit(Request(PROMPTS[3], GenParams(max_tokens=30)))
    assert full.value.retry_after >= 1
    # Step 1: (N̂ + admitted + 1) × k̄ = 3 × 1 <= 12 admits all three (prefill only).
    assert engine.step().admitted == 3 and sched.queue_depth == 0
    assert sched.n_hat == pytest.approx(1.5) and sched.k_bar == 1.0
    # Step 2 decodes the three with k̂ = 8: N̂ = 0.5·1.5 + 0.5·3, k̄ = 0.5·1 + 0.5·8.
    assert engine.step().verify_lens == [8, 8, 8]
    assert sched.n_hat == pytest.approx(2.25) and sched.k_bar == pytest.approx(4.5)
    for p in PROMPTS[3:6]:
        engine.submit(Request(p, GenParams(max_tokens=30, temperature=0)))
    # A slot is free, but the expected step (2.25 + 1) × 4.5 > 12 tokens: the queue waits.
    assert engine.step().admitted == 0
    assert len(sched.running) == 3 and sched.queue_depth == 3 and sched.free_slots
    # Cancelling a running request frees its slot and reservation before the next step.
    reserved = engine.scheduler.reserved
    engine.cancel(reqs[0].request_id)
    engine.step()
    assert reqs[0].cancelled and reqs[0].request_id not in engine.scheduler.running
    assert engine.scheduler.reserved < reserved or engine.scheduler.running
    # Cancelling a waiting request removes it from the queue.
    waiting = engine.scheduler.pending[-1]
    engine.cancel(waiting.request_id)
    engine.step()
    assert waiting.cancelled and waiting not in engine.scheduler.pending
    engine.run_until_idle()
    assert all(r.finished for r in reqs) and engine.idle and len(engine.scheduler.free_slots) == 4
    assert engine.scheduler.reserved == 0


def test_rejects_requests_it_cannot_serve(tiny64):
    engine = Engine(tiny64, None, EngineConfig(method="ar", max_model_len=64))
    with pytest.raises(InputError, match="needs a drafter"):
        engine.submit(Request([256, 1], GenParams(method="dflash")))
    with pytest.raises(InputError, match="per-request limit"):
        engine.submit(Request([256] * 40, GenParams(max_tokens=30)))
    with pytest.raises(InputError, match="temperature"):
        engine.submit(Request([256], GenParams(temperature=-1)))
    with pytest.raises(InputError, match="vocabulary"):
        engine.submit(Request([9999], GenParams(max_tokens=8)))


def test_hot_reload_is_lossless_and_bad_checkpoints_are_rejected(tiny64, trained, ar_ref, tmp_path):
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash", max_running=8), "A")
    reloader = DrafterReloader(engine)
    # B differs in everything but the target: depth, block size, weights.
    b = quick_train(make_bundle(tiny64, num_layers=1, block_size=4, seed=9), tiny64, 30, seed=9)
    good = save_drafter(tmp_path / "B", b.drafter, b.length_head, b.meta)
    reqs = [engine.submit(Request(p, GenParams(max_tokens=40, temperature=0))) for p in PROMPTS[:12]]
    for _ in range(6):
        engine.step()
    assert reloader.reload(good, "B").result(timeout=30) == "B"
    assert engine.drafter_version == "A"  # staged, not swapped mid-step
    late = [engine.submit(Request(p, GenParams(max_tokens=40, temperature=0))) for p in PROMPTS[12:]]
    engine.run_until_idle()
    assert engine.drafter_version == "B" and engine.reloads == 1 and engine.block_size == 4
    assert [r.output_ids for r in reqs + late] == ar_ref
    assert all(r.drafter_version == "B" for r in late)
    assert all(rd.verify_len <= 4 for r in late for rd in r.rounds)

    # Corrupt weights and a drafter for another target: rejected with a reason, B keeps serving.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        reloader.reload(corrupt).result(timeout=30)
    other = make_bundle(tiny64, seed=1)
    other.meta.target_fingerprint = "someoneelse"
    wrong = save_drafter(tmp_path / "wrong", other.drafter, other.length_head, other.meta)
    with pytest.raises(CheckpointError, match="trained for target"):
        reloader.reload(wrong).result(timeout=30)
    again = [engine.submit(Request(p, GenParams(max_tokens=40, temperature=0))) for p in PROMPTS[:4]]
    engine.run_until_idle()
    assert engine.drafter_version == "B" and engine.reloads == 1
    assert [r.output_ids for r in again] == ar_ref[:4]


def test_probe_policy_skips_the_drafter_after_khat_one(tiny64, trained, ar_ref):
    # γ = 0.1 makes every head verdict k̂ = 1: the drafter then runs one round in three.
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash", gamma=0.1, probe_every=3), "v1")
    reqs = _run(engine, PROMPTS)
    assert [r.output_ids for r in reqs] == ar_ref
    for r in reqs:
        assert all(rd.verify_len == 1 for rd in r.rounds)
        drafted = [rd.a_hat is not None for rd in r.rounds]
        assert drafted == [i % 3 == 0 for i in range(len(drafted))]


def test_long_and_short_contexts_attend_in_separate_buckets(tiny64, trained):
    from adaflash.serving.runner import PackedBatch, Segment, _attention_groups

    # One 240-token conversation among short ones: decode attention is bucketed by context
    # length (no padding of every request to 240 keys), and outputs stay exact.
    prompts = [PROMPTS[0] * 30, *PROMPTS[1:6]]
    ref = ar_reference(tiny64, prompts, 30)
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash", max_running=8), "v1")
    reqs = _run(engine, prompts, max_tokens=30)
    assert [r.output_ids for r in reqs] == ref
    batch = PackedBatch.build([Segment(0, 400, [1]), *(Segment(i, 20 + i, [1, 2]) for i in range(1, 6))])
    groups = _attention_groups(batch)
    assert sorted(g.span for g in groups) == [27, 401]


def test_the_engine_packs_its_target_and_drafter_at_construction():
    """A fresh target's and drafter's linear layers are packed before the first request (no caller
    warms the engine by hand), and the packing forward leaves nothing behind: the first request
    still decodes exactly the target's greedy continuation."""
    from adaflash.models.targets import tiny_target

    target = tiny_target(torch.float32, seed=7)
    bundle = make_bundle(target, block_size=8, seed=7)
    modules = [target.model, bundle.drafter]
    modules += [m for layer in target.model.layers for m in (layer.self_attn, layer.mlp)]
    modules += [m for layer in bundle.drafter.layers for m in (layer.self_attn, layer.mlp)]

    def packed(module) -> bool:
        return any(k.startswith("_frozen_") for k in vars(module))

    assert not any(packed(m) for m in modules)
    engine = Engine(target, bundle, EngineConfig(method="adaflash", calibrate=False), "v1")
    assert all(packed(m) for m in modules)
    assert engine.idle and engine.runner.last_num_rows == 0
    req = engine.submit(Request(PROMPTS[0], GenParams(max_tokens=24, temperature=0)))
    engine.run_until_idle()
    assert req.output_ids == ar_reference(target, [PROMPTS[0]], 24)[0]
