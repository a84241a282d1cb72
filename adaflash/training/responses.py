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
from typing import TYPE_CHECKING, Protocol

from adaflash.models.generate import greedy_generate
from adaflash.models.targets import Target
from adaflash.paths import cache_root
from adaflash.workloads import Prompt

if TYPE_CHECKING:
    import torch

MAX_PROMPT_TOKENS = 384  # prompts are cut to their last 384 tokens (chat template included)


@dataclass(frozen=True)
class Response:
    id: str
    domain: str
    prompt_ids: list[int]
    response_ids: list[int]
    complete: bool = True  # False: cut by the budget's deadline (still a greedy prefix)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


class FeatureSink(Protocol):
    """Where the generator's own forward passes leave their features (`feature_store.StoreWriter`):
    a protocol, so the feature store may import this module and not the other way round."""

    @property
    def layer_ids(self) -> tuple[int, ...]: ...

    def add(self, r: Response, rows: torch.Tensor) -> None: ...

    def flush(self) -> None: ...


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
    batch_size: int = 128,
    report_every: int = 32,
    min_partial_tokens: int = 32,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    deadline: float | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    features: FeatureSink | None = None,
) -> list[Response]:
    """Responses for `prompts` (cached ones reused); stops at `deadline` (time.time()),
    keeping every response finished by then. `batch_size` is the number of decode slots.
    With `features`, the generator's own forward passes fill the feature store as it goes
    (no second target pass over the responses)."""
    have = {r.id: r for r in read_responses(path)}
    todo = [p for p in prompts if p.id not in have]
    if not todo or (deadline is not None and time.time() > deadline):
        return [have[p.id] for p in prompts if p.id in have]
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    ids = [tok.chat_prompt(p.text)[-max_prompt_tokens:] for p in todo]
    done = {"prompts": 0, "tokens": 0}
    with path.open("a") as f:
        captured: dict[int, object] = {}

        def persist(i: int, resp: list[int], complete: bool = True) -> None:
            r = Response(todo[i].id, todo[i].domain, ids[i], list(resp), complete)
            rows = captured.pop(i, None)
            if features is not None and rows is not None:
                features.add(r, rows)  # before the cache line: a reader never finds ids without rows
            have[r.id] = r
            f.write(json.dumps(asdict(r)) + "\n")
            f.flush()  # an interrupted run keeps every finished response
            done["prompts"] += 1
            done["tokens"] += len(resp)
            if on_progress and done["prompts"] % report_every == 0:
                on_progress(report_every, done["tokens"])

        # One continuous batch over everything missing; slots refill as responses finish.
        out = greedy_generate(
            target.model,
            ids,
            max_new_tokens,
            tok.eos_token_ids,
            slots=batch_size,
            on_done=persist,
            deadline=deadline,
            capture_layers=features.layer_ids if features else (),
            on_features=captured.__setitem__ if features else None,
        )
        # Responses cut by the deadline are still the target's greedy prefixes: keep the
        # longer ones rather than throw the compute away.
        for i, resp in enumerate(out):
            if resp is not None and todo[i].id not in have and len(resp) >= min_partial_tokens:
                persist(i, resp, complete=False)
    if features is not None:
        features.flush()
    if on_progress and done["prompts"] % report_every:
        on_progress(done["prompts"] % report_every, done["tokens"])
    return [have[p.id] for p in prompts if p.id in have]
