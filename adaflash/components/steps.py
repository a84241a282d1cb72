"""The continual-training steps as plain functions; the KFP components are thin wrappers.

  ingest       clean records not yet trained on → a snapshot (train + held-out split) with lineage
  train        warm-start from the champion, OPD (or a baseline) on the snapshot → challenger dir
  shadow_eval  challenger vs champion on held-out recent traffic, same engine, same prompts
  gate         promote only when the challenger wins by a margin and no domain regresses

Keeping them framework-free means `kfp.local`, a Kubeflow cluster and the tests run the same code.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.feedback.schema import CleanRecord
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.lineage import LineageStore


@dataclass
class Snapshot:
    """What one pipeline run trains and evaluates on, and exactly where it came from."""

    train: list[CleanRecord]
    heldout: list[CleanRecord]
    shard_ids: list[str]
    lineage: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        for name, recs in (("train", self.train), ("heldout", self.heldout)):
            (path / f"{name}.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in recs))
        (path / "lineage.json").write_text(
            json.dumps({"shard_ids": self.shard_ids, **self.lineage}, indent=2)
        )

    @classmethod
    def load(cls, path: Path) -> Snapshot:
        def read(name: str) -> list[CleanRecord]:
            lines = (path / f"{name}.jsonl").read_text().splitlines()
            return [CleanRecord.model_validate_json(x) for x in lines if x]

        lineage = json.loads((path / "lineage.json").read_text())
        return cls(read("train"), read("heldout"), lineage.pop("shard_ids"), lineage)


class NotEnoughData(AdaFlashError):
    """Fewer new clean records than a training run needs."""


def ingest(
    governance_dir: Path, min_records: int = 128, heldout_fraction: float = 0.2, seed: int = 0
) -> Snapshot:
    """Every clean shard no drafter version has trained on; records split by a seeded shuffle.

    Held-out records are as recent as the training ones and never trained on, so the shadow
    evaluation sees the traffic the fleet is serving now.
    """
    store = LineageStore(governance_dir / "lineage.sqlite")
    try:
        shards = store.untrained_shards()
    finally:
        store.close()
    buffer = ReplayBuffer(governance_dir / "buffer")
    records = [r for s in shards for r in buffer.read_shard(buffer.root / s["path"])]
    if len(records) < min_records:
        raise NotEnoughData(f"{len(records)} new clean records; a run needs at least {min_records}")
    records.sort(key=lambda r: r.record.record_id)
    random.Random(seed).shuffle(records)
    n_held = max(1, int(len(records) * heldout_fraction))
    heldout, train = records[:n_held], records[n_held:]
    tenants = sorted({r.record.tenant_id for r in records})
    offsets: dict[str, list[int]] = {}
    for r in records:
        key = f"{r.provenance.topic}/{r.provenance.partition}"
        lo, hi = offsets.get(key, [r.provenance.offset, r.provenance.offset])
        offsets[key] = [min(lo, r.provenance.offset), max(hi, r.provenance.offset)]
    lineage = {
        "records": len(records),
        "train_records": len(train),
        "heldout_records": len(heldout),
        "train_record_ids": sorted(r.record.record_id for r in train),
        "tenants": tenants,
        "offsets": offsets,
        "ingested_at": time.time(),
    }
    return Snapshot(train, heldout, [s["shard_id"] for s in shards], lineage)


@dataclass(frozen=True)
class GatePolicy:
    min_gain: float = 0.02  # the challenger's `metric` must beat the champion's by this fraction
    max_domain_regression: float = 0.02  # no domain's metric or served τ may drop by more than this
    # "tau_full": acceptance over the full block (uncensored, DESIGN §1) — the drafter's quality
    # even while the length head still verifies k̂ = 1 and the served τ cannot move yet; the served
    # τ is then guarded against regression. "tau" (served) or "tps" gate on serving directly.
    metric: str = "tau_full"
    # A domain with fewer held-out records than this cannot veto a promotion on its own: a τ over
    # three prompts moves by more than the tolerance from one prompt's luck. It still counts in "all".
    min_domain_records: int = 5


@dataclass
class GateDecision:
    promote: bool
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def gate(champion: dict, challenger: dict, policy: GatePolicy = GatePolicy()) -> GateDecision:
    """Compare two `shadow_eval` reports (per-domain dicts with "all")."""
    reasons = []
    if not challenger.get("lossless", False):
        reasons.append("challenger outputs differ from the target's greedy outputs")
    m = policy.metric
    base, new = champion["domains"]["all"][m], challenger["domains"]["all"][m]
    if new < base * (1 + policy.min_gain):
        reasons.append(f"{m} {new:.3f} does not beat the champion's {base:.3f} by {policy.min_gain:.0%}")
    tol = 1 - policy.max_domain_regression
    for dom, row in challenger["domains"].items():
        old = champion["domains"].get(dom)
        if not old or (dom != "all" and row.get("n", policy.min_domain_records) < policy.min_domain_records):
            continue
        for key in dict.fromkeys((m, "tau")):
            if (dom != "all" or key != m) and row[key] < old[key] * tol:
                reasons.append(f"domain {dom}: {key} {row[key]:.3f} regresses from {old[key]:.3f}")
    return GateDecision(not reasons, reasons or [f"{m} {new:.3f} vs champion {base:.3f}"])


def shadow_eval(
    target,
    drafter_dir: Path,
    heldout: list[CleanRecord],
    concurrency: int = 8,
    max_new_tokens: int = 64,
    reference: dict[str, list[int]] | None = None,
) -> dict:
    """Serve the held-out prompts with `drafter_dir` (adaflash, T=0) on our engine, per domain.

    Reports τ, mean k̂, target-verified tokens per output token, TPS at `concurrency`, the length
    head's calibration error against the uncensored label, τ over the full block (`tau_full`), and
    whether outputs equal the AR reference (lossless check; `reference` maps record id → AR token
    ids, computed if missing).
    """
    from adaflash.models.checkpoint import load_drafter_for
    from adaflash.serving.speculative import DecodeConfig, SpeculativeDecoder

    bundle = load_drafter_for(drafter_dir, target)
    prompts = [(r.record.record_id, r.record.domain or "unknown", r.record.prompt_token_ids) for r in heldout]
    if reference is None:
        reference = ar_reference(target, prompts, concurrency, max_new_tokens)
    dec = SpeculativeDecoder(target, bundle)
    cfg = DecodeConfig("adaflash", max_new_tokens=max_new_tokens)
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    lossless = True
    for i in range(0, len(prompts), concurrency):
        chunk = prompts[i : i + concurrency]
        t = time.perf_counter()
        results = dec.generate([p for _, _, p in chunk], cfg)
        seconds = time.perf_counter() - t
        for (rid, dom, _), res in zip(chunk, results, strict=True):
            lossless &= res.token_ids == reference[rid]
            for key in (dom, "all"):
                a = acc[key]
                a["n"] += 1
                a["tokens"] += len(res.token_ids)
                a["rounds"] += len(res.rounds)
                a["gained"] += sum(r.accepted + 1 for r in res.rounds)
                a["verified"] += sum(r.verify_len for r in res.rounds)
                a["seconds"] += seconds / len(chunk)
    domains = {
        d: {
            "n": int(a["n"]),
            "tau": a["gained"] / max(a["rounds"], 1),
            "mean_verify_len": a["verified"] / max(a["rounds"], 1),
            "verified_per_output_token": a["verified"] / max(a["tokens"], 1),
            "tps": a["tokens"] / max(a["seconds"], 1e-9),
        }
        for d, a in acc.items()
    }
    # Served rounds are censored by k̂; calibrate against the full block's acceptance instead, by
    # replaying the drafter on the (lossless) greedy continuations.
    calib = calibration(target, bundle, heldout, reference)
    for d, row in domains.items():
        row["calibration_error"] = calib.get(d, {}).get("length_head_mae")
        row["tau_full"] = calib.get(d, {}).get("dflash_tau")
    return {"drafter": str(drafter_dir), "concurrency": concurrency, "lossless": lossless, "domains": domains}


def calibration(target, bundle, heldout: list[CleanRecord], reference: dict[str, list[int]]) -> dict:
    from adaflash.training.blocks import sequence_pass
    from adaflash.training.evaluate import evaluate_acceptance

    seqs = [r.record.prompt_token_ids + reference[r.record.record_id] for r in heldout]
    ids = bundle.drafter.config.target_layer_ids
    passes = [p for i in range(0, len(seqs), 8) for p in sequence_pass(target.model, seqs[i : i + 8], ids)]
    starts = [len(r.record.prompt_token_ids) for r in heldout]
    domains = [r.record.domain or "unknown" for r in heldout]
    return evaluate_acceptance(bundle.drafter, target.model, passes, starts, domains, bundle.length_head)


def ar_reference(target, prompts, concurrency: int, max_new_tokens: int) -> dict[str, list[int]]:
    from adaflash.serving.speculative import DecodeConfig, SpeculativeDecoder

    dec = SpeculativeDecoder(target, None)
    out = {}
    for i in range(0, len(prompts), concurrency):
        chunk = prompts[i : i + concurrency]
        results = dec.generate([p for _, _, p in chunk], DecodeConfig("ar", max_new_tokens=max_new_tokens))
        out.update({rid: r.token_ids for (rid, _, _), r in zip(chunk, results, strict=True)})
    return out
