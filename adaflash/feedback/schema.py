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
    max_tokens: int = 128
    seed: int | None = None


class RoundRecord(_Model):
    start: int  # output index of the round's anchor token
    verify_len: int  # k̂: target-verified block positions, anchor included
    accepted: int  # drafted tokens accepted
    a_hat: float | None = None  # length-head prediction (adaflash only)


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
    method: Literal["ar", "dflash", "adaflash"]
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


class Provenance(_Model):
    """Where a governed record came from, and what governance did to it."""

    topic: str
    partition: int
    offset: int
    governed_at: datetime
    pii_entities: dict[str, int] = Field(default_factory=dict)  # scrubbed entity type -> count
    scrubbed: bool = False  # True when the text/token ids were rewritten


class CleanRecord(_Model):
    """A record that passed governance: PII-free, validated, trainable (`adaflash.feedback.clean`)."""

    record: FeedbackRecord
    provenance: Provenance


class QuarantineReason(_Model):
    code: str  # schema | missing_fields | vocab | rounds | length | flood | near_duplicate | ...
    detail: str = ""


class QuarantineRecord(_Model):
    """A rejected record with its reasons (`adaflash.feedback.quarantine`).

    `record` is the scrubbed record when it parsed; a payload that did not parse keeps only its
    PII-scrubbed text in `raw_scrubbed` and the hash of the original bytes, so nothing personal is
    persisted and the original can still be matched against the producer's logs.
    """

    record_id: str | None
    reasons: list[QuarantineReason]
    provenance: Provenance
    record: FeedbackRecord | None = None
    raw_sha256: str | None = None
    raw_scrubbed: str | None = None


def parse_record(payload: bytes | str) -> FeedbackRecord:
    """Parse one wire payload; anything unparseable or of an unknown version is a `SchemaError`."""
    try:
        data = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SchemaError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SchemaError("payload is not a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"unknown schema_version {version!r} (this build reads {SCHEMA_VERSION})")
    try:
        return FeedbackRecord.model_validate(data)
    except ValidationError as exc:
        fields = sorted({".".join(str(p) for p in e["loc"]) for e in exc.errors()})
        raise SchemaError(f"invalid fields: {', '.join(fields)}") from None
