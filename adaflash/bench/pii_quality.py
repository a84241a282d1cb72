"""PII quality beside throughput (issue 33): record-level recall on the probe corpus's two parts
and the share of a PII-free corpus that governance alters.

Recall is measured on what governance emits for a record: the clean record's texts and what its
token ids decode to, or the quarantine record. A probe counts as caught only if none of its
secrets (and no part of 3+ letters of a planted name) is left there. The corpora live in the
repository's tests (`tests/pii_probe*.py`, `tests/pii_free_corpus.py`); outside a checkout the
bench reports without them.
"""

from __future__ import annotations

import random
import re
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

from adaflash.feedback.schema import FeedbackRecord, Latency, SamplingParams
from adaflash.governance.governor import Governor, Message
from adaflash.governance.synthetic import _rounds


def probe_record(vocab, prompt: str, output: str, when: datetime, rng: random.Random) -> FeedbackRecord:
    """A served record carrying `prompt`/`output` (the PII probes' and the tests' one builder)."""
    tok = vocab.tokenizer
    p_ids, o_ids = tok.encode(prompt), tok.encode(output)
    return FeedbackRecord(
        request_id=uuid.UUID(int=rng.getrandbits(128)).hex,
        tenant_id=f"tenant-{rng.randrange(8):02d}",
        created_at=when,
        target_fingerprint=vocab.fingerprint,
        drafter_version="3",
        method="adaflash",
        block_size=16,
        sampling=SamplingParams(temperature=0.0, max_tokens=256),
        prompt_text=tok.decode(p_ids),
        output_text=tok.decode(o_ids),
        prompt_token_ids=p_ids,
        output_token_ids=o_ids,
        rounds=_rounds(len(o_ids), 16, rng),
        latency=Latency(ttft_ms=30.0, e2e_ms=500.0),
        finish_reason="stop",
    )


def leaks(secrets, name_parts, text: str) -> list[str]:
    bad = [s for s in secrets if s in text]
    return bad + [p for p in name_parts if re.search(rf"(?<!\w){re.escape(p)}(?!\w)", text)]


def emitted(gov: Governor, records: list[FeedbackRecord]) -> dict[str, str]:
    """record id -> everything governance emits for it (texts, decoded token ids, quarantine)."""
    out = gov.govern([Message("probe", 0, i, None, r.to_bytes()) for i, r in enumerate(records)])
    tok = gov.vocab.tokenizer
    per: dict[str, list[str]] = {r.record_id: [] for r in records}
    for c in out.clean:
        ids = tok.decode(c.record.prompt_token_ids) + "\n" + tok.decode(c.record.output_token_ids)
        per[c.record.record_id] += [c.model_dump_json(), c.record.prompt_text, c.record.output_text, ids]
    for q in out.quarantined:
        per.setdefault(q.record_id or "", []).append(q.model_dump_json())
    return {k: "\n".join(v) for k, v in per.items()}


def probe_recall(gov: Governor, probes, seed: int = 0) -> dict:
    """Record-level recall overall, without split-turn probes, per kind and per placement."""
    rng = random.Random(seed)
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    recs = [
        probe_record(gov.vocab, p.prompt, p.output, t0 + timedelta(seconds=i), rng)
        for i, p in enumerate(probes)
    ]
    stored = emitted(gov, recs)
    caught: dict[str, Counter] = {"kind": Counter(), "placement": Counter()}
    total: dict[str, Counter] = {"kind": Counter(), "placement": Counter()}
    misses = []
    for r, p in zip(recs, probes, strict=True):
        ok = not leaks(p.secrets, p.name_parts, stored[r.record_id])
        for axis, key in (("kind", p.kind), ("placement", p.placement.split(":")[0])):
            total[axis][key] += 1
            caught[axis][key] += ok
        if not ok:
            misses.append((p.kind, p.placement))
    n_split = total["placement"]["split"]
    n_caught = sum(caught["kind"].values())
    return {
        "records": len(probes),
        "recall": round(n_caught / max(len(probes), 1), 4),
        "recall_without_split": round(
            (n_caught - caught["placement"]["split"]) / max(len(probes) - n_split, 1), 4
        ),
        "by_kind": {k: round(caught["kind"][k] / v, 3) for k, v in sorted(total["kind"].items())},
        "by_placement": {
            k: round(caught["placement"][k] / v, 3) for k, v in sorted(total["placement"].items())
        },
        "misses": misses,
    }


def altered_share(scrubber, corpus: list[tuple[str, str]]) -> dict:
    """Share of PII-free records the scrubber changes, per group, with the entity kinds it saw."""
    results = scrubber.scrub([t for _, t in corpus])
    altered: Counter = Counter()
    total: Counter = Counter()
    kinds: Counter = Counter()
    for (group, _), r in zip(corpus, results, strict=True):
        total[group] += 1
        if r.spans or r.unsure:
            altered[group] += 1
            kinds.update(s.entity for s in r.spans)
    return {
        "records": len(corpus),
        "altered": sum(altered.values()),
        "altered_share": round(sum(altered.values()) / max(len(corpus), 1), 4),
        "by_group": {g: f"{altered[g]}/{n}" for g, n in total.items()},
        "kinds": dict(kinds),
    }


def pii_quality(gov: Governor) -> dict:
    """Both probe parts' recall and the PII-free corpus's altered share, when the corpora exist."""
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]  # a checkout: the corpora sit in its tests/
    if (repo / "tests" / "pii_probe.py").exists() and str(repo) not in sys.path:
        sys.path.append(str(repo))
    try:
        from tests.pii_free_corpus import pii_free_corpus
        from tests.pii_probe import tuning_probes
        from tests.pii_probe_heldback import heldback_probes
    except ImportError:  # not a checkout: the corpora are test data
        return {}
    import tempfile

    from adaflash.governance.governor import GovernanceConfig

    with tempfile.TemporaryDirectory() as tmp:  # a fresh governor (lineage of its own), same scrubber
        probe_gov = Governor(GovernanceConfig(data_dir=Path(tmp)), gov.vocab, gov.scrubber)
        tuning = probe_recall(probe_gov, tuning_probes())
        held = probe_recall(probe_gov, heldback_probes(), seed=1)
        probe_gov.lineage.close()
    held.pop("misses")  # nobody tunes against the held-back part
    free = altered_share(gov.scrubber, pii_free_corpus())
    return {
        "pii_free_altered_share": free["altered_share"],  # the headline numbers beside throughput
        "probe_recall_tuning": tuning["recall"],
        "probe_recall_heldback": held["recall"],
        "probe_tuning": tuning,
        "probe_heldback": held,
        "pii_free": free,
    }
