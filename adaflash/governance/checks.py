"""Per-record validation as a Great Expectations suite over derived columns.

Each record becomes one row of numbers derived from it (token-id range, round invariants, lengths,
repetition...), and each expectation names the quarantine reason it enforces in its `meta`. GX
reports the failing rows by `record_id`; those rows and the expectation names become the reasons.
Values of failing rows stay in memory: only expectation names and record ids are ever persisted.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass

from adaflash.feedback.schema import FeedbackRecord
from adaflash.models.tokenizer import Tokenizer

GX_BATCH_LIMIT = 100_000


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 4096
    max_block_size: int = 64
    min_distinct_4gram_ratio: float = 0.3  # below: degenerate repetition
    repetition_min_tokens: int = 32  # shorter outputs are too short to judge


def distinct_ngram_ratio(ids: list[int], n: int = 4) -> float:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def non_finite_fields(rec: FeedbackRecord) -> list[str]:
    """Dotted paths of the record's non-finite floats. JSON readers turn 1e400 into inf and accept
    NaN/Infinity literals; pydantic keeps them, but a record is written to the buffer as JSON, where
    they become null and the shard no longer validates (issue 32). Every numeric field, not a list
    of the ones known today: a new field must not reopen the hole."""
    out: list[str] = []
    stack: list[tuple[str, object]] = [("", rec.model_dump())]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            out.append(path)
        elif isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}", x) for i, x in enumerate(v))
    return sorted(out)


def derive_row(rec: FeedbackRecord, tokenizer: Tokenizer, vocab_size: int, limits: Limits) -> dict:
    """The numbers each expectation reads; every rule has a single column."""
    ids = rec.prompt_token_ids + rec.output_token_ids
    n_out = len(rec.output_token_ids)
    r = rec.rounds
    chain_breaks = sum(1 for a, b in zip(r, r[1:], strict=False) if b.start != a.start + a.accepted + 1)
    a_hats = [x.a_hat for x in r if x.a_hat is not None]
    in_vocab = all(0 <= i < vocab_size for i in ids)
    return {
        "record_id": rec.record_id,
        "min_token_id": min(ids) if ids else 0,
        "max_token_id": max(ids) if ids else 0,
        "n_prompt_tokens": len(rec.prompt_token_ids),
        "n_output_tokens": n_out,
        # Out-of-vocabulary ids are the `vocab` rule's; decoding them is not defined.
        "text_matches_tokens": not in_vocab
        or (
            tokenizer.decode(rec.prompt_token_ids) == rec.prompt_text
            and tokenizer.decode(rec.output_token_ids) == rec.output_text
        ),
        "rounds_min_verify_len": min((x.verify_len for x in r), default=1),
        "rounds_max_verify_excess": max((x.verify_len - rec.block_size for x in r), default=0),
        "rounds_max_accept_excess": max((x.accepted - (x.verify_len - 1) for x in r), default=0),
        "rounds_min_accepted": min((x.accepted for x in r), default=0),
        "rounds_first_start": r[0].start if r else 0,
        "rounds_max_start_excess": max((x.start - (n_out - 1) for x in r), default=0),
        "rounds_chain_breaks": chain_breaks,
        "a_hat_min": min(a_hats, default=0.0),
        "a_hat_max": max(a_hats, default=0.0),
        "block_size": rec.block_size,
        "gamma": rec.gamma,
        "temperature": rec.sampling.temperature,
        "distinct_4gram_ratio": distinct_ngram_ratio(rec.output_token_ids)
        if n_out >= limits.repetition_min_tokens
        else 1.0,
        "consent": rec.consent,
        "target_fingerprint": rec.target_fingerprint,
    }


class RecordValidator:
    """Builds the suite once (GX context setup costs seconds) and validates DataFrames of rows."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, fingerprint: str, limits: Limits = Limits()):
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        logging.getLogger("great_expectations").setLevel(logging.ERROR)
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
        asset = ctx.data_sources.add_pandas("feedback").add_dataframe_asset("batch")
        self._batch_def = asset.add_batch_definition_whole_dataframe("all")
        E = gx.expectations
        rules = [
            ("vocab", E.ExpectColumnValuesToBeBetween(column="min_token_id", min_value=0)),
            ("vocab", E.ExpectColumnValuesToBeBetween(column="max_token_id", max_value=vocab_size - 1)),
            (
                "length",
                E.ExpectColumnValuesToBeBetween(
                    column="n_prompt_tokens", min_value=1, max_value=limits.max_prompt_tokens
                ),
            ),
            (
                "length",
                E.ExpectColumnValuesToBeBetween(
                    column="n_output_tokens", min_value=1, max_value=limits.max_output_tokens
                ),
            ),
            ("inconsistent", E.ExpectColumnValuesToBeInSet(column="text_matches_tokens", value_set=[True])),
            ("rounds", E.ExpectColumnValuesToBeBetween(column="rounds_min_verify_len", min_value=1)),
            ("rounds", E.ExpectColumnValuesToBeBetween(column="rounds_max_verify_excess", max_value=0)),
            ("rounds", E.ExpectColumnValuesToBeBetween(column="rounds_max_accept_excess", max_value=0)),
            ("rounds", E.ExpectColumnValuesToBeBetween(column="rounds_min_accepted", min_value=0)),
            ("rounds", E.ExpectColumnValuesToBeInSet(column="rounds_first_start", value_set=[0])),
            ("rounds", E.ExpectColumnValuesToBeBetween(column="rounds_max_start_excess", max_value=0)),
            ("rounds", E.ExpectColumnValuesToBeInSet(column="rounds_chain_breaks", value_set=[0])),
            ("values", E.ExpectColumnValuesToBeBetween(column="a_hat_min", min_value=0.0)),
            ("values", E.ExpectColumnValuesToBeBetween(column="a_hat_max", max_value=1.0)),
            (
                "values",
                E.ExpectColumnValuesToBeBetween(
                    column="block_size", min_value=1, max_value=limits.max_block_size
                ),
            ),
            ("values", E.ExpectColumnValuesToBeBetween(column="gamma", min_value=0.0, strict_min=True)),
            ("values", E.ExpectColumnValuesToBeBetween(column="temperature", min_value=0.0)),
            (
                "repetition",
                E.ExpectColumnValuesToBeBetween(
                    column="distinct_4gram_ratio", min_value=limits.min_distinct_4gram_ratio
                ),
            ),
            ("consent", E.ExpectColumnValuesToBeInSet(column="consent", value_set=[True])),
            ("target", E.ExpectColumnValuesToBeInSet(column="target_fingerprint", value_set=[fingerprint])),
        ]
        suite = gx.ExpectationSuite("adaflash_feedback")
        for reason, exp in rules:
            exp.meta = {"reason": reason}
            suite.add_expectation(exp)
        self._suite = ctx.suites.add(suite)

    def reasons(self, records: list[FeedbackRecord]) -> dict[str, list[tuple[str, str]]]:
        """record_id -> [(reason code, expectation detail)] for the records that fail any rule."""
        import pandas as pd

        if not records:
            return {}
        df = pd.DataFrame([derive_row(r, self.tokenizer, self.vocab_size, self.limits) for r in records])
        result = self._batch_def.get_batch(batch_parameters={"dataframe": df}).validate(
            self._suite,
            result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["record_id"]},
        )
        out: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for r in result.results:
            if r.success:
                continue
            cfg = r.expectation_config
            detail = f"{cfg.type}({cfg.kwargs.get('column')})"
            for row in r.result.get("unexpected_index_list") or []:
                out[row["record_id"]].append((cfg.meta["reason"], detail))
        return dict(out)
