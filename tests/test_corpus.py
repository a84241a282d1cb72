"""The committed response corpus round-trips: ids only in git, prompts re-tokenised on load, and
a row whose prompt no longer tokenises the same is skipped (regenerated, never misaligned)."""

from __future__ import annotations

import gzip
import json

from adaflash.training.corpus import export_corpus, seed_cache
from adaflash.training.responses import ensure_responses, read_responses
from adaflash.workloads import Prompt


def test_corpus_round_trip_and_stale_rows(tiny32, tmp_path):
    prompts = [Prompt(f"p/{i}", "math", f"what is {i} + {i}?") for i in range(6)]
    made = ensure_responses(tiny32, prompts, tmp_path / "a.jsonl", 16, batch_size=3)
    corpus = tmp_path / "corpus.jsonl.gz"
    assert export_corpus(made, corpus) == 6
    with gzip.open(corpus, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert all("text" not in r and "prompt_ids" not in r for r in rows)  # no prompt text at rest
    # Prompt 0's text changed since the corpus was written: its row must not be reused.
    edited = [Prompt("p/0", "math", "a different question"), *prompts[1:]]
    cache = tmp_path / "b.jsonl"
    assert seed_cache(tiny32, edited, corpus, cache) == 5
    by_id = {r.id: r for r in read_responses(cache)}
    assert "p/0" not in by_id
    for r in made[1:]:
        assert by_id[r.id].tokens == r.tokens
    assert seed_cache(tiny32, edited, corpus, cache) == 0  # idempotent
