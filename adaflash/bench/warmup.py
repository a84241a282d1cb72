"""The bench's cache warm-up: serve the first part of a prompt set with feedback on, govern the
records the way the stack does (the real `Governor`: Presidio, Great Expectations, the filters),
and feed the clean ones to the engine's suffix cache through the serving side's own `CleanFeed`
code path. The timed prompts are never part of it, and what the timed cells serve is never
learned (a repeat of a cell would otherwise find its own answers in the cache).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from adaflash.bench import closed_loop
from adaflash.feedback import topics
from adaflash.governance.governor import GovernanceConfig, Governor, Message
from adaflash.governance.pii import PiiScrubber
from adaflash.models.targets import Vocabulary
from adaflash.serving.engine import Engine, GenParams, Request
from adaflash.serving.feedback_emitter import build_record
from adaflash.serving.suffix_feed import CleanFeed

_SCRUBBER: PiiScrubber | None = None  # Presidio + spaCy load once per process (~10 s)


def _scrubber() -> PiiScrubber:
    global _SCRUBBER
    if _SCRUBBER is None:
        _SCRUBBER = PiiScrubber()
    return _SCRUBBER


def serve_all(
    engine: Engine, prompts: list[list[int]], tenant: str, max_new: int, concurrency: int
) -> list[Request]:
    """Serve `prompts` greedily (plain decoding: the outputs are what any method would commit),
    `concurrency` at a time, as `tenant`."""
    tok = engine.target.tokenizer

    def make(ids: list[int]) -> Request:
        params = GenParams(max_new, 0.0, method="ar")
        return Request(ids, params, prompt_text=tok.decode(ids), tenant_id=tenant)

    return closed_loop.serve(engine, prompts, make, concurrency)[0]


def warm_suffix_cache(
    engine: Engine,
    prompts: list[list[int]],
    tenant: str,
    max_new: int,
    concurrency: int = 8,
    work_dir: Path | None = None,
) -> dict:
    """Serve, govern and learn `prompts` for `tenant`; what governance did, in numbers."""
    t0 = time.perf_counter()
    reqs = serve_all(engine, prompts, tenant, max_new, concurrency)
    served_s = time.perf_counter() - t0
    target = engine.target
    vocab = Vocabulary(target.name, target.tokenizer, target.config.vocab_size, target.fingerprint)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        gov = Governor(GovernanceConfig(data_dir=Path(tmp)), vocab, _scrubber())
        messages = [
            Message(topics.RAW, 0, i, tenant.encode(), build_record(engine, r).to_bytes())
            for i, r in enumerate(reqs)
        ]
        t1 = time.perf_counter()
        out = gov.govern(messages)
        governed_s = time.perf_counter() - t1
        gov.lineage.close()
    feed = CleanFeed(engine.suffix_cache, "", target.fingerprint)
    added = sum(
        feed.apply(c.model_dump_json().encode(), f"{topics.CLEAN}/bench", i) for i, c in enumerate(out.clean)
    )
    return {
        "tenant": tenant,
        "served": len(reqs),
        "clean": len(out.clean),
        "quarantined": dict(out.reasons),
        "pii_scrubbed": dict(out.pii),
        "learned": int(added),
        "cache_tokens": engine.suffix_cache.stats().tokens,
        "serve_s": served_s,
        "govern_s": governed_s,
    }
