"""What a quarantined record keeps at rest (issue 13): only what an auditor needs.

Reasons, record id, tenant, keyed hashes of the original texts (so the original can be matched
against the producer's logs without storing it), and the scrubbed texts only when both PII
layers passed them. Token ids, rounds and the rest of the record are not kept: a quarantined
record is never trained on, and every extra field is one more place for personal data to hide.

The hashes are HMAC-SHA256 with a secret key (issue 33): a plain SHA-256 of a templated prompt
with a 9-digit id is brute-forced in minutes. The key comes from `ADAFLASH_QUARANTINE_HASH_KEY`
(in production a Kubernetes Secret mounted as that variable) or from the file named by
`ADAFLASH_QUARANTINE_HASH_KEY_FILE`; `ADAFLASH_QUARANTINE_HASH_KEY_ID` names it. Each stored hash
reads `hmac-sha256:<key id>:<hex>`, so rotating is a config change (a new key under a new id):
hashes made under an old key stay checkable by whoever holds that key (`matches`). Without a
configured key a random one is drawn per process, with a warning: its hashes can neither be
brute-forced nor matched later. That is fine on one machine, but a cluster's auditors need to
match hashes, so the Deployment sets `ADAFLASH_QUARANTINE_HASH_KEY_REQUIRED=true` and a missing
key stops governance at start instead. A configured key that cannot be read, or one shorter than
16 bytes (a guessable key is as weak as no key), stops it everywhere. The key is resolved when a
`Governor` is built, so all of this shows at start, not at the first quarantined record.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.feedback.schema import FeedbackRecord, Provenance, QuarantineReason, QuarantineRecord

log = logging.getLogger(__name__)

KEY_ENV = "ADAFLASH_QUARANTINE_HASH_KEY"
KEY_FILE_ENV = "ADAFLASH_QUARANTINE_HASH_KEY_FILE"
KEY_ID_ENV = "ADAFLASH_QUARANTINE_HASH_KEY_ID"
REQUIRED_ENV = "ADAFLASH_QUARANTINE_HASH_KEY_REQUIRED"
MIN_KEY_BYTES = 16
_SCHEME = "hmac-sha256"


class HashKeyError(AdaFlashError):
    """The quarantine hash key is required but missing, unreadable or too short."""


@dataclass(frozen=True)
class HashKey:
    key_id: str
    secret: bytes

    def hash(self, text: str) -> str:
        mac = hmac.new(self.secret, text.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return f"{_SCHEME}:{self.key_id}:{mac.hexdigest()}"


def key_from_env(env: Mapping[str, str] | None = None) -> HashKey:
    """The configured key (see the module doc), or a random per-process one."""
    env = os.environ if env is None else env
    key_id = env.get(KEY_ID_ENV, "default")
    secret = _configured_secret(env)
    if secret is not None:
        if len(secret) < MIN_KEY_BYTES:
            raise HashKeyError(
                f"the quarantine hash key {key_id!r} has {len(secret)} bytes, at least {MIN_KEY_BYTES} are "
                "needed (make one with `openssl rand -hex 32`)"
            )
        return HashKey(key_id, secret)
    if env.get(REQUIRED_ENV, "").strip().lower() in ("1", "true", "yes"):
        raise HashKeyError(
            f"{REQUIRED_ENV} is set but neither {KEY_ENV} nor {KEY_FILE_ENV} is: quarantine hashes "
            "would use a random key nobody can match later (mount the quarantine-hash-key Secret)"
        )
    log.warning(
        "no %s / %s: quarantine hashes use a random per-process key and cannot be matched later",
        KEY_ENV,
        KEY_FILE_ENV,
    )
    return HashKey("ephemeral-" + secrets.token_hex(4), secrets.token_bytes(32))


def _configured_secret(env: Mapping[str, str]) -> bytes | None:
    if env.get(KEY_ENV):
        return env[KEY_ENV].encode()
    if not env.get(KEY_FILE_ENV):
        return None
    path = Path(env[KEY_FILE_ENV])
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise HashKeyError(
            f"{KEY_FILE_ENV}={path}: cannot read the quarantine hash key ({exc.strerror})"
        ) from None
    if not secret:
        raise HashKeyError(f"{KEY_FILE_ENV}={path} is empty")
    return secret


@lru_cache(maxsize=1)
def process_key() -> HashKey:
    """This process's key, resolved once (the `Governor` asks at construction, so a missing or bad
    key shows at start)."""
    return key_from_env()


def keyed_hash(text: str, key: HashKey | None = None) -> str:
    return (key or process_key()).hash(text)


def matches(text: str, stored: str, keys: dict[str, bytes]) -> bool:
    """Whether `stored` (`hmac-sha256:<id>:<hex>`) is the hash of `text` under the key of its id."""
    scheme, _, rest = stored.partition(":")
    key_id, _, _ = rest.partition(":")
    if scheme != _SCHEME or key_id not in keys:
        return False
    return hmac.compare_digest(HashKey(key_id, keys[key_id]).hash(text), stored)


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
        prompt_sha256=keyed_hash(rec.prompt_text),
        output_sha256=keyed_hash(rec.output_text),
        prompt_scrubbed=scrubbed.prompt_text if scrubbed is not None else None,
        output_scrubbed=scrubbed.output_text if scrubbed is not None else None,
    )
