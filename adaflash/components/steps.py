"""The continual-training steps as plain functions; the KFP components are thin wrappers.

  ingest       (components/ingest.py) clean records not yet trained on → a snapshot (train +
               held-out split) with lineage
  champion     the registry's champion (or the bootstrap drafter before the first promotion)
  train        warm-start from the champion, OPD (or a baseline) on the snapshot → challenger dir;
               `train_process` is the same as a process of its own (one rank of a torchrun launch)
  shadow_gate  challenger vs champion on the held-out records (served on the engine, same prompts, one
               AR reference), then `gate` (components/gate.py): promote only when a paired
               bootstrap interval of the per-record τ gain clears the bar and no domain regresses
  register     the challenger as a registry version with its lineage, shadow metrics and the
               gate's intervals; its records marked trained in the lineage store
  promote      auto-promotion of a winning challenger
  record_run   the exit handler's line in the pipeline run log

Each component body only moves artifacts and calls one of these, so `kfp.local`, a Kubeflow
cluster and the tests run the same code.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from adaflash.components.gate import GateDecision, GatePolicy, gate
from adaflash.components.ingest import Snapshot
from adaflash.feedback.schema import CleanRecord
from adaflash.governance.config import GovernanceConfig
from adaflash.governance.lineage import LineageStore

if TYPE_CHECKING:  # annotations only: the steps import models and training inside the functions
    from adaflash.models.targets import Target
    from adaflash.training.distributed import DataParallel
    from adaflash.training.online import OnlineConfig

log = logging.getLogger(__name__)


LOSSES = ("opd", "osd", "fkl")  # online training objectives (training/online.py)


def shadow_eval(
    target,
    drafter_dir: Path,
    heldout: list[CleanRecord],
    concurrency: int = 8,
    max_new_tokens: int = 64,
    reference: dict[str, list[int]] | None = None,
    gamma: float = 1.0,
) -> dict:
    """Serve the held-out prompts with `drafter_dir` (adaflash, T=0) on the serving engine at
    `concurrency` (continuous batching, as served), one domain at a time, and report per domain:
    τ, mean k̂, target-verified tokens per output token, serving TPS (wall clock, and per CPU-second
    of this process: time slicing on a shared machine does not move it), the length head's
    calibration error against the uncensored label, τ over the full block (`tau_full`), and
    whether outputs equal the AR reference (lossless check; `reference` maps record id → AR token
    ids, computed on the same engine if missing). `records` holds each record's served and
    full-block τ: what the gate pairs between two drafters. `gamma`: the fleet's k̂ = ⌊γ·â·k⌋, so
    the served τ is the one the fleet would serve.
    """
    from adaflash.models.checkpoint import load_drafter_for

    bundle = load_drafter_for(drafter_dir, target)
    prompts = prompts_of(heldout)
    if reference is None:
        reference = ar_reference(target, prompts, concurrency, max_new_tokens)
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    records: dict[str, dict] = {}
    lossless = True
    for dom in sorted({d for _, d, _ in prompts}):
        chunk = [p for p in prompts if p[1] == dom]
        served = serve_greedy(target, bundle, "adaflash", chunk, concurrency, max_new_tokens, gamma)
        for (rid, _, _), res in zip(chunk, served.requests, strict=True):
            lossless &= res.output_ids == reference[rid]
            gained = sum(r.accepted + 1 for r in res.rounds)
            records[rid] = {"domain": dom, "tokens": len(res.output_ids), "rounds": len(res.rounds),
                            "tau": gained / max(len(res.rounds), 1)}  # fmt: skip
            for key in (dom, "all"):
                a = acc[key]
                a["n"] += 1
                a["tokens"] += len(res.output_ids)
                a["rounds"] += len(res.rounds)
                a["gained"] += gained
                a["verified"] += sum(r.verify_len for r in res.rounds)
        for key in (dom, "all"):
            acc[key]["seconds"] += served.seconds
            acc[key]["cpu_seconds"] += served.cpu_seconds
    # Served rounds are censored by k̂; calibrate against the full block's acceptance instead, by
    # replaying the drafter on the (lossless) greedy continuations.
    for rec, seq in zip(heldout, calibration(target, bundle, heldout, reference, gamma), strict=True):
        row = records[rec.record.record_id]
        row["tau_full"] = seq.tau_full
        a = acc[row["domain"]], acc["all"]
        for x in a:
            x["full_tokens"] += seq.full_tokens
            x["full_rounds"] += seq.full_rounds
            if seq.head_rounds is not None:
                x["head_abs_err"] += seq.head_abs_err
                x["head_rounds"] += seq.head_rounds
    domains = {
        d: {
            "n": int(a["n"]),
            "tau": a["gained"] / max(a["rounds"], 1),
            "mean_verify_len": a["verified"] / max(a["rounds"], 1),
            "verified_per_output_token": a["verified"] / max(a["tokens"], 1),
            "tps": a["tokens"] / max(a["seconds"], 1e-9),
            "tokens_per_cpu_s": a["tokens"] / max(a["cpu_seconds"], 1e-9),
            "tau_full": a["full_tokens"] / max(a["full_rounds"], 1),
            "full_rounds": int(a["full_rounds"]),
            "calibration_error": a["head_abs_err"] / a["head_rounds"] if a["head_rounds"] else None,
        }
        for d, a in acc.items()
    }
    return {"drafter": str(drafter_dir), "concurrency": concurrency, "gamma": gamma, "lossless": lossless,
            "domains": domains, "records": records}  # fmt: skip


def calibration(
    target, bundle, heldout: list[CleanRecord], reference: dict[str, list[int]], gamma: float = 1.0
) -> list:
    """Per held-out record (in order), the drafter's replayed rounds on the greedy continuation:
    full-block τ and the length head's |â − a*| (`training.evaluate.SequenceAcceptance`)."""
    from adaflash.training.blocks import sequence_pass
    from adaflash.training.evaluate import acceptance_per_sequence

    seqs = [r.record.prompt_token_ids + reference[r.record.record_id] for r in heldout]
    ids = bundle.drafter.config.target_layer_ids
    passes = [p for i in range(0, len(seqs), 8) for p in sequence_pass(target.model, seqs[i : i + 8], ids)]
    starts = [len(r.record.prompt_token_ids) for r in heldout]
    return acceptance_per_sequence(bundle.drafter, target.model, passes, starts, bundle.length_head, gamma)


@dataclass
class Served:
    requests: list  # finished engine Requests, in prompt order
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time over the same span


def serve_greedy(
    target, bundle, method: str, prompts, concurrency: int, max_new_tokens: int, gamma: float = 1.0
) -> Served:
    """Greedy decoding of (id, domain, prompt ids) on the serving engine with `concurrency`
    slots — what serving would do with them."""
    from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request

    queue = max(len(prompts), 1)
    cfg = EngineConfig(method=method, gamma=gamma, max_running=concurrency, max_queue=queue, calibrate=False)
    engine = Engine(target, bundle, cfg, "shadow")  # packs the weights, untimed
    t0, cpu0 = time.perf_counter(), time.process_time()
    reqs = [engine.submit(Request(list(p), GenParams(max_tokens=max_new_tokens))) for _, _, p in prompts]
    engine.run_until_idle()
    return Served(reqs, time.perf_counter() - t0, time.process_time() - cpu0)


def ar_reference(target, prompts, concurrency: int, max_new_tokens: int) -> dict[str, list[int]]:
    served = serve_greedy(target, None, "ar", prompts, concurrency, max_new_tokens)
    return {rid: r.output_ids for (rid, _, _), r in zip(prompts, served.requests, strict=True)}


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
        """The challenger's headline numbers per domain, each beside the champion's, and the
        gate's intervals (KFP Metrics)."""
        out = {}
        for dom, row in self.challenger["domains"].items():
            old = self.champion["domains"].get(dom, row)
            for k in ("tau", "tau_full", "mean_verify_len", "tps", "tokens_per_cpu_s"):
                out[f"{dom}.{k}"] = round(float(row[k]), 4)
                out[f"{dom}.{k}.champion"] = round(float(old[k]), 4)
        for key, row in gate_summary(self.decision.to_dict()).items():
            for k, v in row.items():
                out[f"gate.{key}.{k}"] = round(float(v), 4)
        return out


def gate_summary(decision: dict) -> dict[str, dict[str, float]]:
    """A GateDecision's dict → {"<metric>.<domain>": n, gain, low, high, and promote (1/0) under
    "decision"}: the intervals as KFP Metrics and the registry store them."""
    out: dict[str, dict[str, float]] = {"decision": {"promote": float(decision["promote"])}}
    for iv in decision["intervals"]:
        out[f"{iv['metric']}.{iv['domain']}"] = {k: iv[k] for k in ("n", "gain", "low", "high")}
    return out


def shadow_gate(
    target,
    heldout: list[CleanRecord],
    champion_dir: Path,
    challenger_dir: Path,
    policy: GatePolicy,
    concurrency: int = 8,
    max_new_tokens: int = 64,
    gamma: float = 1.0,
) -> ShadowReport:
    """Shadow-evaluate both drafters against one AR reference, then gate the challenger."""
    ref = ar_reference(target, prompts_of(heldout), concurrency, max_new_tokens)
    old = shadow_eval(target, champion_dir, heldout, concurrency, max_new_tokens, ref, gamma)
    new = shadow_eval(target, challenger_dir, heldout, concurrency, max_new_tokens, ref, gamma)
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
        # The champion by the promotion records, what the fleet serves: an alias moved outside the
        # registry client is not the baseline a challenger must beat (issue 32).
        audit = reg.audit_champion()
        version = audit.authorised or audit.recorded_version or ""
        src = reg.download(version) if version else Path(fallback_dir)
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
    # Replayed records trained an ancestor already: the length head does not learn from them.
    replayed = snapshot.lineage.get("replay_record_ids", ())
    metrics = trainer.train(snapshot.train, lineage=lineage, replayed=replayed)
    world = data_parallel.world_size if data_parallel else 1
    # The budget as it ran, in steps: what a reader of the registry compares across versions.
    return {"loss": cfg.loss, "train_tau_last_epoch": metrics["epochs"][-1]["train_tau"],
            "records": metrics["records"], "epochs": cfg.epochs, "steps": metrics["steps"],
            "lr": cfg.lr, "workers": world}  # fmt: skip


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
    training: dict | None = None,
) -> str:
    """Register the challenger with its lineage, shadow metrics and the gate's intervals (`shadow`:
    a ShadowReport's dict, also logged whole as the run's `shadow_report.json`) — pending approval
    when the gate said promote in manual mode — and mark its records trained in the lineage store.
    `training`: the train step's summary (records, epochs, steps, ...), logged as `train.*` metrics."""
    from datetime import UTC, datetime

    lineage = {
        "shards": snapshot.shard_ids,
        "n_records": snapshot.lineage["train_records"],
        "tenants": snapshot.lineage["tenants"],
        "offsets": snapshot.lineage["offsets"],
        "train_record_ids": snapshot.lineage["train_record_ids"],
        "heldout_records": snapshot.lineage["heldout_records"],
        "heldout_by_domain": snapshot.lineage.get("heldout_by_domain", {}),
    }
    metrics = {"shadow": shadow["challenger"]["domains"], "champion": shadow["champion"]["domains"],
               "gate": gate_summary(shadow["gate"]), "train": training or {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, _registry(target, tracking_uri, bootstrap_servers) as reg:
        version = reg.register(
            with_shadow_evidence(challenger_dir, shadow["challenger"], Path(tmp)),
            lineage=lineage,
            metrics=metrics,
            reports={"shadow_report": shadow},  # per-record τ of both drafters, intervals, policy
            gate=(decision, "; ".join(shadow["gate"]["reasons"])),
            reason=f"pipeline run: shadow gate said {decision}: {'; '.join(shadow['gate']['reasons'])}",
            pending_approval=(gate_mode == "manual" and decision == "promote"),
        )
    store = LineageStore(GovernanceConfig(governance_dir).lineage_path)
    try:
        store.mark_trained(
            snapshot.shard_ids, version, datetime.now(UTC).isoformat(), snapshot.lineage["train_record_ids"]
        )
    finally:
        store.close()
    return version


def with_shadow_evidence(drafter_dir: Path, shadow: dict, tmp: Path) -> Path:
    """A copy of `drafter_dir` (under `tmp`) carrying its shadow evaluation as release evidence
    (full-block τ on the held-out records, `models/evidence.py`): what a server that installs the
    version prices it by. The step's input artifact itself is left as it came."""
    from adaflash.models.checkpoint import stamp_evidence
    from adaflash.models.evidence import AcceptanceEvidence
    from adaflash.serving.export import drafter_block_size

    whole = shadow["domains"].get("all", {})
    if not whole.get("full_rounds"):
        return drafter_dir  # nothing was measured: serving falls back to its generic prior
    out = tmp / drafter_dir.name
    shutil.copytree(drafter_dir, out)
    block = drafter_block_size(out)
    n = whole.get("n", 0)
    stamp_evidence(out, AcceptanceEvidence.from_tau(whole["tau_full"], block - 1, whole["full_rounds"],
                                           f"shadow evaluation on {n} held-out records"))  # fmt: skip
    return out


def promote(target: str, tracking_uri: str, bootstrap_servers: str, version: str, reason: str) -> None:
    """Auto-promotion: the challenger beat the champion in shadow evaluation."""
    with _registry(target, tracking_uri, bootstrap_servers) as reg:
        reg.promote(version, who="pipeline", reason=reason)


def record_run(governance_dir: Path, pipeline_job: str, state: str, error: str | None) -> None:
    """Append a run's final state (and error, if any) to the pipeline run log."""
    entry = {"at": time.time(), "pipeline_job": pipeline_job, "state": state, "error": error or None}
    with open(governance_dir / "pipeline_runs.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
