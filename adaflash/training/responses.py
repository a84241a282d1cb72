"""The target's own greedy responses to workload prompts: the bootstrap's training data.

Generation is the expensive part of the bootstrap on CPU (~100-200 tok/s), so responses are
cached on disk per target fingerprint and reused by every later run; a run only generates what
is missing and can be interrupted at any point (each finished chunk is appended and flushed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from adaflash.models.generate import greedy_generate
from adaflash.models.targets import Target, cache_root
from adaflash.workloads import Prompt


@dataclass(frozen=True)
class Response:
    id: str
    domain: str
    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def responses_path(target: Target, split: str, max_new_tokens: int) -> Path:
    return cache_root() / "data" / target.fingerprint / f"{split}-greedy-{max_new_tokens}.jsonl"


def read_responses(path: Path) -> list[Response]:
    if not path.exists():
        return []
    out = []
    with path.open() as f:
        for line in f:
            try:
                out.append(Response(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue  # a torn last line from an interrupted run: regenerate that prompt
    return out


def ensure_responses(
    target: Target,
    prompts: Sequence[Prompt],
    path: Path,
    max_new_tokens: int,
    batch_size: int = 256,
    max_prompt_tokens: int = 384,
    deadline: float | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[Response]:
    """Responses for `prompts` (cached ones reused); stops early at `deadline` (time.time())."""
    have = {r.id: r for r in read_responses(path)}
    todo = [p for p in prompts if p.id not in have]
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    done_tokens = 0
    with path.open("a") as f:
        for start in range(0, len(todo), batch_size):
            if deadline is not None and time.time() > deadline:
                break
            chunk = todo[start : start + batch_size]
            ids = [tok.chat_prompt(p.text)[-max_prompt_tokens:] for p in chunk]
            # Similar lengths in one batch waste less padding in the prefill.
            order = sorted(range(len(chunk)), key=lambda i: len(ids[i]))
            outs = greedy_generate(target.model, [ids[i] for i in order], max_new_tokens, tok.eos_token_ids)
            for i, resp in zip(order, outs, strict=True):
                r = Response(chunk[i].id, chunk[i].domain, ids[i], resp)
                have[r.id] = r
                f.write(json.dumps(asdict(r)) + "\n")
                done_tokens += len(resp)
            f.flush()
            if on_progress:
                on_progress(len(chunk), done_tokens)
    return [have[p.id] for p in prompts if p.id in have]
