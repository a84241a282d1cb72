"""The replay window (training/replay.py): bounded, recency-weighted, capped per tenant, seeded."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash.feedback.schema import CleanRecord, FeedbackRecord
from adaflash.training.replay import ReplayWindow, replay_sample
from tests.conftest import clean_record

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def record(i: int, tenant: str, age_s: float) -> CleanRecord:
    rec = FeedbackRecord(
        record_id=f"r{i:05d}",
        request_id=str(i),
        tenant_id=tenant,
        domain="code",
        created_at=T0 - timedelta(seconds=age_s),
        target_fingerprint="fp",
        method="adaflash",
        block_size=16,
        prompt_text="p",
        output_text="o",
        prompt_token_ids=[1, 2],
        output_token_ids=[3],
        rounds=[],
    )
    return clean_record(rec, offset=i, governed_at=T0)


@settings(max_examples=60, deadline=None)
@given(
    ages=st.lists(st.tuples(st.integers(0, 3), st.floats(0, 1e5)), min_size=0, max_size=60),
    size=st.integers(0, 40),
    cap=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    seed=st.integers(0, 5),
)
def test_window_is_bounded_capped_per_tenant_and_reproducible(ages, size, cap, seed):
    pool = [record(i, f"t{t}", a) for i, (t, a) in enumerate(ages)]
    excluded = {c.record.record_id for c in pool[::5]}
    window = ReplayWindow(size, half_life_s=3600.0, tenant_cap=cap)
    got = replay_sample(pool, window, seed, exclude=excluded)
    ids = [c.record.record_id for c in got]
    assert len(ids) <= size and len(set(ids)) == len(ids) and ids == sorted(ids)
    assert not set(ids) & excluded
    assert max(Counter(c.record.tenant_id for c in got).values(), default=0) <= window.per_tenant
    eligible = Counter(c.record.tenant_id for c in pool if c.record.record_id not in excluded)
    # It fills the window as far as the caps allow: nothing eligible is left out for no reason.
    assert len(ids) == min(size, sum(min(n, window.per_tenant) for n in eligible.values()))
    assert [c.record.record_id for c in replay_sample(pool, window, seed, exclude=excluded)] == ids


def test_recent_records_are_replayed_far_more_often_than_old_ones():
    # 100 records a day old and 100 fresh ones; a one-hour half-life: the window is nearly all fresh.
    pool = [record(i, f"t{i % 10}", 86400.0) for i in range(100)]
    pool += [record(100 + i, f"t{i % 10}", 0.0) for i in range(100)]
    got = replay_sample(pool, ReplayWindow(50, half_life_s=3600.0, tenant_cap=1.0), seed=3)
    fresh = sum(int(c.record.record_id[1:]) >= 100 for c in got)
    assert len(got) == 50 and fresh == 50
    # A half-life far longer than the ages: both halves come through (no recency preference).
    flat = replay_sample(pool, ReplayWindow(50, half_life_s=1e9, tenant_cap=1.0), seed=3)
    fresh_flat = sum(int(c.record.record_id[1:]) >= 100 for c in flat)
    assert 10 < fresh_flat < 40


def test_one_tenant_cannot_dominate_the_window():
    pool = [record(i, "flood", 0.0) for i in range(200)]
    pool += [record(200 + i, f"q{i}", 600.0) for i in range(10)]
    got = replay_sample(pool, ReplayWindow(40, tenant_cap=0.25), seed=0)
    by = Counter(c.record.tenant_id for c in got)
    assert by["flood"] == 10 and len(got) == 20  # 10 of the flood + every quiet tenant's one record


def test_window_rejects_nonsense():
    for bad in ({"max_records": -1}, {"half_life_s": 0.0}, {"tenant_cap": 0.0}, {"tenant_cap": 1.5}):
        with pytest.raises(ValueError):
            ReplayWindow(**bad)
    assert replay_sample([record(0, "t", 0.0)], ReplayWindow(0)) == []
