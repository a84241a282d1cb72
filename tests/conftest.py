from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

# ADAFLASH_THREADS=1 lets the suite share 2 cores with another torch job without oversubscription
# (two OpenMP pools on the same cores slow both down ~10x).
torch.set_num_threads(int(os.environ.get("ADAFLASH_THREADS", "2")))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Tests never touch the user's cache; SmolLM2's dequantised copy is shared across the session.
    if "ADAFLASH_TEST_CACHE" not in os.environ:
        os.environ["ADAFLASH_TEST_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    monkeypatch.setenv(
        "ADAFLASH_CACHE", os.environ.get("ADAFLASH_CACHE_SHARED", os.environ["ADAFLASH_TEST_CACHE"])
    )


@pytest.fixture(scope="session")
def tiny64():
    from adaflash.models.targets import tiny_target

    return tiny_target(torch.float64)


@pytest.fixture(scope="session")
def tiny32():
    from adaflash.models.targets import tiny_target

    return tiny_target(torch.float32)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking + registry server (SQLite, local artifacts), one per test module."""
    from adaflash.feedback.broker import free_port
    from adaflash.registry.server import RegistryServer

    server = RegistryServer(tmp_path_factory.mktemp("mlflow"), port=free_port())
    server.start()
    yield server
    server.stop()


# A tiny target of its own per test module (float32, seed 0): a module may pack, hook or cache on it.
@pytest.fixture(scope="module")
def tiny():
    from adaflash.models.targets import tiny_target

    return tiny_target()


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, tiny):
    """Three distinct tiny drafters (seeds 0, 1, 2; blocks of 8) saved in DFlash format."""
    from adaflash.models.checkpoint import save_drafter

    root = tmp_path_factory.mktemp("drafters")
    out = []
    for seed in (0, 1, 2):
        b = make_bundle(tiny, seed=seed)
        out.append(save_drafter(root / f"drafter-{seed}", b.drafter, b.length_head, b.meta))
    return out


def make_bundle(target, num_layers=2, block_size=8, seed=0, with_head=True):
    from adaflash.models.checkpoint import DrafterBundle, DrafterMeta
    from adaflash.models.factory import new_drafter

    d, h = new_drafter(target, num_layers=num_layers, block_size=block_size, num_feature_layers=2, seed=seed)
    meta = DrafterMeta(target.fingerprint, target.name, target.config.hidden_size, target.config.vocab_size)
    return DrafterBundle(d.eval(), h.eval() if with_head else None, meta)


def ar_reference(target, prompts, max_new_tokens):
    """Greedy continuations from the target alone (`greedy_generate`: a padded batch, not the
    serving engine), eos included: the independent reference every lossless test compares to."""
    from adaflash.models.generate import greedy_generate

    return greedy_generate(target.model, prompts, max_new_tokens, target.tokenizer.eos_token_ids)


def clean_record(record, offset: int = 0, topic: str = "adaflash.feedback.raw", governed_at=None):
    """`record` (a FeedbackRecord) as governance publishes it clean: from `topic`, partition 0,
    `offset`, governed at `governed_at` (default now)."""
    from adaflash.feedback.schema import CleanRecord, Provenance

    when = governed_at or datetime.now(UTC)
    prov = Provenance(topic=topic, partition=0, offset=offset, governed_at=when)
    return CleanRecord(record=record, provenance=prov)


def served_record(target, bundle, prompt_ids, result, method: str = "dflash", **fields):
    """The feedback record serving emits for one decoded `result` (a `GenerationResult` of
    `prompt_ids`): its texts, tokens and rounds; `fields` give the rest (ids, tenant, domain...)."""
    from adaflash.feedback.schema import FeedbackRecord, RoundRecord

    rounds, start = [], 0
    for rd in result.rounds:
        rounds.append(
            RoundRecord(start=start, verify_len=rd.verify_len, accepted=rd.accepted, a_hat=rd.a_hat)
        )
        start += rd.accepted + 1
    tok = target.tokenizer
    return FeedbackRecord(
        target_fingerprint=target.fingerprint,
        method=method,
        block_size=bundle.drafter.block_size,
        prompt_text=tok.decode(prompt_ids),
        output_text=tok.decode(result.token_ids),
        prompt_token_ids=prompt_ids,
        output_token_ids=result.token_ids,
        rounds=rounds,
        **fields,
    )


REPO = Path(__file__).resolve().parents[1]


# Governance tests: the tiny target's vocabulary and a Presidio scrubber, one of each per module.
@pytest.fixture(scope="module")
def vocab():
    from adaflash.models.targets import load_vocabulary

    return load_vocabulary("tiny")


@pytest.fixture(scope="module")
def scrubber():
    from adaflash.governance.pii import PiiScrubber

    return PiiScrubber()
