"""The committed response corpus: the target's greedy responses, kept in git without the prompts.

Generating responses is the slowest part of a bootstrap on a CPU, and a fresh machine has no
cache, so the response token ids are committed under `data/responses/<fingerprint[:16]>/`
(gzip'd JSON lines: prompt id, a hash of the prompt's token ids, the response ids). The prompts
themselves are re-read from the prompt sets (never committed, see workloads.py) and re-tokenised;
a row whose prompt no longer tokenises to the same ids (another tokenizer, edited data) is skipped
and regenerated instead of trained on misaligned text.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from adaflash.models.targets import Target
from adaflash.training.responses import MAX_PROMPT_TOKENS, Response, read_responses
from adaflash.workloads import Prompt

CORPUS_ROOT = Path(__file__).resolve().parents[2] / "data" / "responses"


def corpus_path(target: Target, split: str, max_new_tokens: int, root: Path = CORPUS_ROOT) -> Path:
    return root / target.fingerprint[:16] / f"{split}-greedy-{max_new_tokens}.jsonl.gz"


def _prompt_hash(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:12]


def export_corpus(responses: Sequence[Response], path: Path) -> int:
    """Write the responses' ids (no prompt text) to `path`; returns the rows written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", compresslevel=9) as f:
        for r in sorted(responses, key=lambda r: r.id):
            row = {"id": r.id, "domain": r.domain, "prompt": _prompt_hash(r.prompt_ids),
                   "response_ids": r.response_ids, "complete": r.complete}  # fmt: skip
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return len(responses)


def seed_cache(target: Target, prompts: Sequence[Prompt], corpus: Path, cache: Path) -> int:
    """Append to the response cache every corpus row for `prompts` that it lacks; returns count."""
    if not corpus.exists():
        return 0
    have = {r.id for r in read_responses(cache)}
    wanted = {p.id: p for p in prompts if p.id not in have}
    if not wanted:
        return 0
    added = []
    with gzip.open(corpus, "rt") as f:
        for line in f:
            row = json.loads(line)
            p = wanted.get(row["id"])
            if p is None:
                continue
            ids = target.tokenizer.chat_prompt(p.text)[-MAX_PROMPT_TOKENS:]
            if _prompt_hash(ids) != row["prompt"]:
                continue
            added.append(Response(p.id, p.domain, ids, row["response_ids"], row["complete"]))
    if added:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with cache.open("a") as f:
            for r in added:
                f.write(json.dumps(asdict(r)) + "\n")
    return len(added)
