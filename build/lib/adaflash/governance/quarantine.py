"""What a quarantined record keeps at rest (issue 13): only what an auditor needs.

Reasons, record id, tenant, hashes of the original texts (so the original can be matched against
the producer's logs without storing it), and the scrubbed texts only when both PII layers passed
them. Token ids, rounds and the rest of the record are not kept: a quarantined record is never
trained on, and every extra field is one more place for personal data to hide.
"""

from __future__ import annotations

import hashlib

from adaflash.feedback.schema import FeedbackRecord, Provenance, QuarantineReason, QuarantineRecord


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def audit_quarantine(
    rec: FeedbackRecord,
    reasons: list[QuarantineReason],
    prov: Provenance,
    scrubbed: FeedbackRecord | None,
) -> QuarantineRecord:
    """`scrubbed`: the governed record when its texts may be kept (both layers passed), else None."""
    return QuarantineRecord(
        record_id=rec.record_id,
        reasons=reasons,
        provenance=prov,
        tenant_id=rec.tenant_id,
        prompt_sha256=sha256(rec.prompt_text),
        output_sha256=sha256(rec.output_text),
        prompt_scrubbed=scrubbed.prompt_text if scrubbed is not None else None,
        output_scrubbed=scrubbed.output_text if scrubbed is not None else None,
    )
