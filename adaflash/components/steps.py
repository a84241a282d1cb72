"""The continual-training steps as plain functions; the KFP components are thin wrappers.

  ingest       clean records not yet trained on → a snapshot (train + held-out split) with lineage
  champion     the registry's champion (or the bootstrap drafter before the first promotion)
  train        warm-start from the champion, OPD (or a baseline) on the snapshot → challenger dir;
               `train_process` is the same as a process of its own (one rank of a torchrun launch)
  shadow_gate  challenger vs champion on the held-out records (served on the engine, same prompts, one
               AR reference), then `gate`: promote only when the challenger wins by a margin
               and no domain regresses
  register     the challenger as a registry version with its lineage and shadow metrics; its
               records marked trained in the lineage store
  promote      auto-promotion of a winning challenger
  record_run   the exit handler's line in the pipeline run log

Each component body only moves artifacts and calls one of these, so `kfp.local`, a Kubeflow
cluster and the tests run the same code.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from adaflash.errors import AdaFlashError
from adaflash.feedback.schema import CleanRecord
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.lineage import LineageStore

if TYPE_CHECKING:  # annotations only: the steps import models and training inside the functions
    from adaflash.models.targets import Target
    from adaflash.training.distributed import DataParallel
    from adaflash.training.online import OnlineConfig


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

    def summary(self) -> dict:
        return {"records": self.lineage["records"], "shards": len(self.shard_ids),
                "tenants": len(self.lineage["tenants"])}  # fmt: skip

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


LOSSES = ("opd", "osd", "fkl")  # online training objectives (training/online.py)
GATE_METRICS = ("tau_full", "tau", "tps")  # what GatePolicy.metric may name
GATE_MODES = ("auto", "manual")  # manual: a winner waits, pending approval, for a person


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
    """Serve the held-out prompts with `drafter_dir` (adaflash, T=0) on the serving engine at
    `concurrency` (continuous batching, as served), one domain at a time, and report per domain:
    τ, mean k̂, target-verified tokens per output token, serving TPS, the length head's calibration
    error against the uncensored label, τ over the full block (`tau_full`), and whether outputs
    equal the AR reference (lossless check; `reference` maps record id → AR token ids, computed on
    the same engine if missing).
    """
    from adaflash.models.checkpoint import load_drafter_for

    bundle = load_drafter_for(drafter_dir, target)
    prompts = prompts_of(heldout)
    if reference is None:
        reference = ar_reference(target, prompts, concurrency, max_new_tokens)
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    lossless = True
    for dom in sorted({d for _, d, _ in prompts}):
        chunk = [p for p in prompts if p[1] == dom]
        results, seconds = serve_greedy(target, bundle, "adaflash", chunk, concurrency, max_new_tokens)
        for (rid, _, _), res in zip(chunk, results, strict=True):
            lossless &= res.output_ids == reference[rid]
            for key in (dom, "all"):
                a = acc[key]
                a["n"] += 1
                a["tokens"] += len(res.output_ids)
                a["rounds"] += len(res.rounds)
                a["gained"] += sum(r.accepted + 1 for r in res.rounds)
                a["verified"] += sum(r.verify_len for r in res.rounds)
        for key in (dom, "all"):
            acc[key]["seconds"] += seconds
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


def serve_greedy(target, bundle, method: str, prompts, concurrency: int, max_new_tokens: int):
    """(finished requests in prompt order, wall seconds): greedy decoding of (id, domain, prompt
    ids) on the serving engine with `concurrency` slots — what serving would do with them."""
    from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request

    queue = max(len(prompts), 1)
    cfg = EngineConfig(method=method, max_running=concurrency, max_queue=queue, calibrate=False)
    engine = Engine(target, bundle, cfg, "shadow")
    t0 = time.perf_counter()
    reqs = [engine.submit(Request(list(p), GenParams(max_tokens=max_new_tokens))) for _, _, p in prompts]
    engine.run_until_idle()
    return reqs, time.perf_counter() - t0


def ar_reference(target, prompts, concurrency: int, max_new_tokens: int) -> dict[str, list[int]]:
    reqs, _ = serve_greedy(target, None, "ar", prompts, concurrency, max_new_tokens)
    return {rid: r.output_ids for (rid, _, _), r in zip(prompts, reqs, strict=True)}


def prompts_of(records: list[CleanRecord]) -> list[tuple[str, str, list[int]]]:
    """(record id, domain, prompt ids): what the decoders take."""
    return [(r.record.record_id, r.record.domain or "unknown", r.record.prompt_token_ids) for r in records]


@dataclass
class ShadowReport:
    champion: dict  # shadow_eval reports
    challenger: dict
    decision: GateDecision

    def to_dict(self) -> dict:
        return {"champion": self.champion, "challenger": self.challenger, "gate": self.decision.to_dict()}

    def metrics(self) -> dict[str, float]:
        """The challenger's headline numbers per domain, each beside the champion's (KFP Metrics)."""
        out = {}
        for dom, row in self.challenger["domains"].items():
            old = self.champion["domains"].get(dom, row)
            for k in ("tau", "tau_full", "mean_verify_len", "tps"):
                out[f"{dom}.{k}"] = round(float(row[k]), 4)
                out[f"{dom}.{k}.champion"] = round(float(old[k]), 4)
        return out


def shadow_gate(
    target,
    heldout: list[CleanRecord],
    champion_dir: Path,
    challenger_dir: Path,
    policy: GatePolicy,
    concurrency: int = 8,
    max_new_tokens: int = 64,
) -> ShadowReport:
    """Shadow-evaluate both drafters against one AR reference, then gate the challenger."""
    ref = ar_reference(target, prompts_of(heldout), concurrency, max_new_tokens)
    old = shadow_eval(target, champion_dir, heldout, concurrency, max_new_tokens, ref)
    new = shadow_eval(target, challenger_dir, heldout, concurrency, max_new_tokens, ref)
    return ShadowReport(old, new, gate(old, new, policy))


def _registry(target: str, tracking_uri: str, bootstrap_servers: str = ""):
    from adaflash.models.targets import load_vocabulary
    from adaflash.registry.client import RegistryClient

    return RegistryClient(
        tracking_uri, load_vocabulary(target).fingerprint, bootstrap_servers=bootstrap_servers or None
    )


@dataclass(frozen=True)
class Champion:
    version: str  # "" before the first promotion
    source: str  # the version, or "bootstrap:<dir>": the challenger's lineage parent


def champion(target: str, tracking_uri: str, fallback_dir: str, out: Path) -> Champion:
    """Copy the registry's champion (or the bootstrap drafter before the first promotion) to `out`."""
    import shutil

    with _registry(target, tracking_uri) as reg:
        version = reg.champion() or ""
        src = reg.download("champion") if version else Path(fallback_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    return Champion(version, version or f"bootstrap:{fallback_dir}")


def step_target(spec: str) -> Target:
    """The target of a GPU step (feature extraction + train, shadow eval): on this pod's GPU when
    it has one, else on the CPU (kfp.local, the local-kind overlay)."""
    from adaflash.models.targets import compute_device, load_target

    return load_target(spec, device=compute_device())


def train(
    target: Target,
    snapshot: Snapshot,
    champion_dir: Path,
    parent: str | None,
    out: Path,
    cfg: OnlineConfig,
    data_parallel: DataParallel | None = None,
) -> dict:
    """Warm-start from the champion and train on the snapshot's records (`cfg`: an OnlineConfig;
    `data_parallel`: this rank's `DataParallel` when launched by torchrun); the challenger lands
    in `out` with its lineage (records, parent). Returns its summary."""
    from adaflash.models.checkpoint import load_drafter_for
    from adaflash.training.online import OnlineTrainer

    lineage = {"train_record_ids": snapshot.lineage["train_record_ids"], "parent": parent}
    bundle = load_drafter_for(champion_dir, target)
    trainer = OnlineTrainer(target, bundle, out, cfg, data_parallel=data_parallel)
    metrics = trainer.train(snapshot.train, lineage=lineage)
    world = data_parallel.world_size if data_parallel else 1
    return {"loss": cfg.loss, "train_tau_last_epoch": metrics["epochs"][-1]["train_tau"], "workers": world}


def train_process(
    target_spec: str, snapshot_dir: Path, champion_dir: Path, parent: str | None, out: Path, cfg: OnlineConfig
) -> dict:
    """`train` as a process of its own: alone, or one rank of `torchrun` (it joins the process
    group the launcher describes; NCCL on a GPU, gloo on the CPU). Rank 0 writes the challenger to
    `out` and the summary to `out`/TRAIN_SUMMARY; every rank returns the summary."""
    from adaflash.training.distributed import process_group

    with process_group() as dp:
        summary = train(
            step_target(target_spec), Snapshot.load(snapshot_dir), champion_dir, parent, out, cfg, dp
        )
        if dp is None or dp.is_main:
            (out / TRAIN_SUMMARY).write_text(json.dumps(summary))
    return summary


TRAIN_SUMMARY = "train_summary.json"


def register(
    target: str,
    tracking_uri: str,
    bootstrap_servers: str,
    governance_dir: Path,
    gate_mode: str,
    decision: str,
    snapshot: Snapshot,
    challenger_dir: Path,
    shadow: dict,
) -> str:
    """Register the challenger with its lineage and shadow metrics (`shadow`: a ShadowReport's
    dict) — pending approval when the gate said promote in manual mode — and mark its records
    trained in the lineage store."""
    from datetime import UTC, datetime

    lineage = {
        "shards": snapshot.shard_ids,
        "n_records": snapshot.lineage["train_records"],
        "tenants": snapshot.lineage["tenants"],
        "offsets": snapshot.lineage["offsets"],
        "train_record_ids": snapshot.lineage["train_record_ids"],
    }
    metrics = {"shadow": shadow["challenger"]["domains"], "champion": shadow["champion"]["domains"]}
    with _registry(target, tracking_uri, bootstrap_servers) as reg:
        version = reg.register(
            challenger_dir,
            lineage=lineage,
            metrics=metrics,
            reason=f"pipeline run: shadow gate said {decision}: {'; '.join(shadow['gate']['reasons'])}",
            pending_approval=(gate_mode == "manual" and decision == "promote"),
        )
    store = LineageStore(governance_dir / "lineage.sqlite")
    try:
        store.mark_trained(
            snapshot.shard_ids, version, datetime.now(UTC).isoformat(), snapshot.lineage["train_record_ids"]
        )
    finally:
        store.close()
    return version


def promote(target: str, tracking_uri: str, bootstrap_servers: str, version: str, reason: str) -> None:
    """Auto-promotion: the challenger beat the champion in shadow evaluation."""
    with _registry(target, tracking_uri, bootstrap_servers) as reg:
        reg.promote(version, who="pipeline", reason=reason)


def record_run(governance_dir: Path, pipeline_job: str, state: str, error: str | None) -> None:
    """Append a run's final state (and error, if any) to the pipeline run log."""
    entry = {"at": time.time(), "pipeline_job": pipeline_job, "state": state, "error": error or None}
    with open(governance_dir / "pipeline_runs.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
