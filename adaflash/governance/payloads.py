"""What governance may learn of a raw payload before trusting it: whether it is over the
poison-pill caps (too big, too deep: quarantined unread), its record id (for dedupe, or an id of
the message when it has none), why it did not parse, and every string in it (each one scrubbed
before a quarantined payload is stored)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from adaflash.feedback.schema import SCHEMA_VERSION, FeedbackRecord
from adaflash.governance.batch import Message
from adaflash.governance.config import GovernanceConfig

# -- poison-pill caps -----------------------------------------------------------------------------------
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth_exceeds(value: bytes, cap: int) -> bool:
    """Whether JSON nesting goes deeper than `cap`, without parsing (brackets inside strings do
    not count). Only payloads with more than `cap` brackets are scanned at all."""
    if value.count(b"[") + value.count(b"{") <= cap:
        return False
    depth = 0
    for m in _BRACKET.finditer(_JSON_STRING.sub(b'""', value)):
        if m.group() in (b"[", b"{"):
            depth += 1
            if depth > cap:
                return True
        else:
            depth -= 1
    return False


def over_caps(value: bytes, cfg: GovernanceConfig) -> tuple[str, str] | None:
    """(reason code, detail) for a payload too big or too deep to read, else None."""
    if len(value) > cfg.max_payload_bytes:
        return "too_large", f"{len(value)} bytes > the {cfg.max_payload_bytes}-byte cap"
    if json_depth_exceeds(value, cfg.max_json_depth):
        return "too_deep", f"JSON nested deeper than {cfg.max_json_depth} levels"
    return None


# -- payloads that did not parse -------------------------------------------------------------------
def _peek_id(value: bytes) -> str | None:
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    rid = data.get("record_id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= 128 else None


def message_id(m: Message, peek: bool = True) -> str:
    """The record id, or for a payload without one an id of this message: identical garbage sent
    twice is two messages, each quarantined; the same message redelivered is a duplicate. A
    payload over the caps is not peeked into (`peek=False`): it gets the message id."""
    rid = _peek_id(m.value) if peek else None
    if rid:
        return rid
    digest = hashlib.sha256(m.value).hexdigest()[:24]
    return f"unparsed-{digest}-{m.topic}-{m.partition}-{m.offset}"


def schema_code(value: bytes) -> str:
    """`missing_fields` for a current-version object lacking required fields, else `schema`."""
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        return "schema"
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        return "schema"
    required = {n for n, f in FeedbackRecord.model_fields.items() if f.is_required()}
    return "missing_fields" if required - data.keys() else "schema"


def strings_of(failed: list[tuple[Message, str, str]]) -> list[tuple[Any, list[str]]]:
    """(parsed JSON or raw text, its strings in order) — every string gets scrubbed before storage."""
    out = []
    for m, _, _ in failed:
        try:
            data: Any = json.loads(m.value)
        except (ValueError, RecursionError):
            data = m.value.decode("utf-8", errors="replace")
        if isinstance(data, dict):  # token ids encode the same text: they cannot be kept unscrubbed
            data = {k: v for k, v in data.items() if not k.endswith("token_ids")}
        strings: list[str] = []
        _walk(data, strings.append)
        out.append((data, strings))
    return out


def _walk(x: Any, visit) -> Any:
    if isinstance(x, str):
        return visit(x)
    if isinstance(x, dict):
        return {k: _walk(v, visit) for k, v in x.items()}
    if isinstance(x, list):
        return [_walk(v, visit) for v in x]
    return x


def rebuild(data: Any, scrubbed: list[str]) -> str:
    it = iter(scrubbed)
    rebuilt = _walk(data, lambda _s: next(it))
    return rebuilt if isinstance(rebuilt, str) else json.dumps(rebuilt)
