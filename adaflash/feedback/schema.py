"""The feedback record: what serving emits per finished request (DESIGN §2), versioned JSON.

`feedback` is a leaf room: serving produces these records, governance validates/scrubs them,
training reads the clean ones. Records never carry vocab-sized tensors — the trainer recomputes
target supervision itself.

Round convention (shared with `serving.speculative.Round`): a round's `start` is the index in
`output_token_ids` of its anchor — the newest committed token when the round began (the previous
round's bonus token; round 0's anchor is the first sampled token, at output index 0). The round
verified `verify_len` = k̂ block positions (anchor included) and accepted `accepted` drafts, so it
committed output tokens start+1 .. start+accepted+1. Hence 0 ≤ accepted ≤ verify_len−1,
1 ≤ verify_len ≤ block_size (an `ar` round has verify_len 1, accepted 0) and
start + accepted + 1 ≤ len(output_token_ids) except for the round cut by eos/max_tokens; the
rounds chain: rounds[i+1].start == rounds[i].start + rounds[i].accepted + 1, rounds[0].start == 0.

Texts: `prompt_text == tokenizer.decode(prompt_token_ids)` and likewise for the output (the
target's tokenizer, special tokens skipped — so a chat prompt's text is its rendered template
without the special markers). Governance checks this and uses it to re-tokenise scrubbed text
while keeping rounds aligned; a record whose texts do not match its ids is quarantined.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """A payload that is not a valid feedback record of a version we understand."""


class _Model(BaseModel):
    # Unknown fields are an error, not silently dropped: a producer on a newer schema must bump
    # `schema_version`, and governance quarantines what it does not understand.
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Model):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    max_tokens: int = 128
    seed: int | None = None


class RoundRecord(_Model):
    start: int  # output index of the round's anchor token
    verify_len: int  # k̂: target-verified block positions, anchor included
    accepted: int  # drafted tokens accepted
    a_hat: float | None = None  # length-head prediction (adaflash only)
    # Who drafted the round: adaflash-cost picks the drafter, n-gram lookup or none (a plain AR
    # round) per request and round. Only drafter rounds say anything about the drafter.
    proposer: Literal["drafter", "ngram", "suffix", "none"] = "drafter"


class Latency(_Model):
    ttft_ms: float  # request arrival -> first output token
    e2e_ms: float  # request arrival -> last output token
    itl_ms: list[float] = Field(default_factory=list)  # per-token inter-token latency


class FeedbackRecord(_Model):
    schema_version: Literal[1] = SCHEMA_VERSION
    record_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    request_id: str
    tenant_id: str
    consent: bool = True  # False: the tenant opted out of training on its traffic
    domain: str | None = None  # optional client tag (math / code / chat / ...)
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    target_fingerprint: str
    drafter_version: str | None = None  # None for `ar`
    method: Literal["ar", "dflash", "adaflash", "adaflash-cost", "ngram", "suffix"]
    block_size: int
    gamma: float = 1.0
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    prompt_text: str
    output_text: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    rounds: list[RoundRecord] = Field(default_factory=list)
    latency: Latency | None = None
    finish_reason: str = "length"

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class ReplacedSpan(_Model):
    """One PII span governance replaced by a surrogate: its kind and character offsets in the
    original text (`start`, `end`) and in the governed text (`new_start`, `new_end`)."""

    where: Literal["prompt", "output"]
    entity: str
    start: int
    end: int
    new_start: int
    new_end: int


class Provenance(_Model):
    """Where a governed record came from, and what governance did to it."""

    topic: str
    partition: int
    offset: int
    governed_at: datetime
    pii_entities: dict[str, int] = Field(default_factory=dict)  # scrubbed entity type -> count
    scrubbed: bool = False  # True when the text/token ids were rewritten
    replaced: list[ReplacedSpan] = Field(default_factory=list)  # what was replaced where, never the value


class CleanRecord(_Model):
    """A record that passed governance: PII-free, validated, trainable (`adaflash.feedback.clean`)."""

    record: FeedbackRecord
    provenance: Provenance


class QuarantineReason(_Model):
    code: str  # schema | missing_fields | vocab | rounds | length | flood | near_duplicate | ...
    detail: str = ""


class QuarantineRecord(_Model):
    """A rejected record with its reasons (`adaflash.feedback.quarantine`).

    Only what an auditor needs is kept: reasons, record id, tenant, hashes of the original bytes
    and texts, and the PII-scrubbed texts only when both PII layers passed them (a record the
    second layer was unsure about keeps no text). A payload that did not parse keeps its scrubbed
    text in `raw_scrubbed` under the same rule, so nothing personal is persisted and the original
    can still be matched against the producer's logs.
    """

    record_id: str | None
    reasons: list[QuarantineReason]
    provenance: Provenance
    record: FeedbackRecord | None = None  # never written (issue 13): the fields below suffice
    raw_sha256: str | None = None
    raw_scrubbed: str | None = None
    # What an auditor needs and nothing more: who, hashes of the original texts (to match a
    # producer's logs), and the scrubbed texts only when both PII layers passed them.
    tenant_id: str | None = None
    prompt_sha256: str | None = None
    output_sha256: str | None = None
    prompt_scrubbed: str | None = None
    output_scrubbed: str | None = None


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_lone_surrogates(data) -> None:
    """JSON's \\ud800 escape decodes to a lone surrogate (a valid pair becomes one character): not
    text, and no UTF-8 writer (Kafka, Parquet, this module's own `to_bytes`) can encode it."""
    stack = [data]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise SchemaError("invalid text: a lone UTF-16 surrogate")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def parse_record(payload: bytes | str) -> FeedbackRecord:
    """Parse one wire payload; anything unparseable or of an unknown version is a `SchemaError`."""
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, an int of > 4300 digits
        raise SchemaError(f"not JSON: {exc}") from None
    except RecursionError:
        raise SchemaError("not JSON this reader accepts: nested too deeply") from None
    if not isinstance(data, dict):
        raise SchemaError("payload is not a JSON object")
    if _ESCAPED_SURROGATE.search(
        payload if isinstance(payload, bytes) else payload.encode("utf-8", "replace")
    ):
        _reject_lone_surrogates(data)
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"unknown schema_version {version!r} (this build reads {SCHEMA_VERSION})")
    try:
        return FeedbackRecord.model_validate(data)
    except ValidationError as exc:
        fields = sorted({".".join(str(p) for p in e["loc"]) for e in exc.errors()})
        raise SchemaError(f"invalid fields: {', '.join(fields)}") from None
