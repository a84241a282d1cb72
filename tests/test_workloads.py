"""Workloads: three domains, fixed splits, held-out never in train."""

from __future__ import annotations

import pytest

from adaflash.errors import AdaFlashError
from adaflash.workloads import DOMAINS, interleave, load_prompts


def test_splits_are_disjoint_deterministic_and_cover_three_domains():
    train, held = load_prompts("train"), load_prompts("heldout")
    assert set(train) == set(held) == set(DOMAINS)
    for d in DOMAINS:
        assert train[d] and held[d]
        assert not {p.id for p in train[d]} & {p.id for p in held[d]}
        assert not {p.text for p in train[d]} & {p.text for p in held[d]}
    assert any(p.id.startswith("gsm8k-heldout/") for p in held["math"])
    assert any(p.id.startswith("humaneval/") for p in held["code"])
    assert load_prompts("heldout") == held


def test_interleave_covers_domains_in_any_prefix():
    mixed = interleave(load_prompts("heldout"), 2)
    assert [p.domain for p in mixed[:3]] == ["math", "code", "chat"]
    assert len(mixed) == 6


def test_missing_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(AdaFlashError, match="does not exist"):
        load_prompts("train", tmp_path / "nope")
    with pytest.raises(AdaFlashError, match="not found"):
        load_prompts("train", tmp_path)
