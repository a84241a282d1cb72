"""KFP v2 lightweight components: typed artifacts around `adaflash.components.steps`.

Each function body imports what it needs (KFP ships only the function's source to the executor).
Locally they run through `kfp.local.SubprocessRunner(use_venv=False)` in this environment; on a
cluster they run in `IMAGE`, which is this package installed (see manifests/).
"""

# No `from __future__ import annotations`: KFP reads the real annotation objects (Input[Dataset]...).
from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

IMAGE = "ghcr.io/adaflash/adaflash:0.1.0"


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def ingest_op(
    governance_dir: str, min_records: int, heldout_fraction: float, snapshot: Output[Dataset]
) -> int:
    """Clean records no version trained on → train/held-out snapshot with lineage."""
    from pathlib import Path

    from adaflash.components.steps import ingest

    snap = ingest(Path(governance_dir), min_records=min_records, heldout_fraction=heldout_fraction)
    snap.save(Path(snapshot.path))
    snapshot.metadata.update(
        {
            "records": snap.lineage["records"],
            "shards": len(snap.shard_ids),
            "tenants": len(snap.lineage["tenants"]),
        }
    )
    return len(snap.train)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def champion_op(target: str, tracking_uri: str, fallback_dir: str, champion: Output[Model]) -> str:
    """The registry's champion (or the bootstrap drafter before the first promotion)."""
    import shutil
    from pathlib import Path

    from adaflash.models.targets import load_vocabulary
    from adaflash.registry.client import RegistryClient

    out = Path(champion.path)
    version = ""
    with RegistryClient(tracking_uri, load_vocabulary(target).fingerprint) as reg:
        version = reg.champion() or ""
        src = reg.download("champion") if version else Path(fallback_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    champion.metadata["version"] = version or f"bootstrap:{fallback_dir}"
    return version


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train_op(
    target: str,
    snapshot: Input[Dataset],
    champion: Input[Model],
    loss: str,
    epochs: int,
    lr: float,
    random_anchors: int,
    challenger: Output[Model],
):
    """Warm-start from the champion; OPD (or osd / fkl) on the snapshot's training records."""
    from pathlib import Path

    from adaflash.components.steps import Snapshot
    from adaflash.models.checkpoint import load_drafter_for
    from adaflash.models.targets import load_target
    from adaflash.training.online import OnlineConfig, OnlineTrainer

    tgt = load_target(target)
    snap = Snapshot.load(Path(snapshot.path))
    cfg = OnlineConfig(loss=loss, epochs=epochs, lr=lr, random_anchors=random_anchors)
    lineage = {
        "train_record_ids": snap.lineage["train_record_ids"],
        "parent": champion.metadata.get("version"),
    }
    metrics = OnlineTrainer(
        tgt, load_drafter_for(Path(champion.path), tgt), Path(challenger.path), cfg
    ).train(snap.train, lineage=lineage)
    challenger.metadata.update({"loss": loss, "train_tau_last_epoch": metrics["epochs"][-1]["train_tau"]})


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def shadow_eval_op(
    target: str,
    snapshot: Input[Dataset],
    champion: Input[Model],
    challenger: Input[Model],
    concurrency: int,
    max_new_tokens: int,
    min_gain: float,
    max_domain_regression: float,
    gate_metric: str,
    report: Output[Artifact],
    metrics: Output[Metrics],
) -> str:
    """Challenger vs champion on held-out recent traffic; returns "promote" or "reject"."""
    import json
    from pathlib import Path

    from adaflash.components.steps import GatePolicy, Snapshot, ar_reference, gate, shadow_eval
    from adaflash.models.targets import load_target

    tgt = load_target(target)
    held = Snapshot.load(Path(snapshot.path)).heldout
    prompts = [(r.record.record_id, r.record.domain or "unknown", r.record.prompt_token_ids) for r in held]
    ref = ar_reference(tgt, prompts, concurrency, max_new_tokens)
    old = shadow_eval(tgt, Path(champion.path), held, concurrency, max_new_tokens, ref)
    new = shadow_eval(tgt, Path(challenger.path), held, concurrency, max_new_tokens, ref)
    policy = GatePolicy(min_gain=min_gain, max_domain_regression=max_domain_regression, metric=gate_metric)
    decision = gate(old, new, policy)
    Path(report.path).write_text(json.dumps({"champion": old, "challenger": new, "gate": decision.to_dict()}))
    for dom, row in new["domains"].items():
        for k in ("tau", "tau_full", "mean_verify_len", "tps"):
            metrics.log_metric(f"{dom}.{k}", round(float(row[k]), 4))
            metrics.log_metric(f"{dom}.{k}.champion", round(float(old["domains"].get(dom, row)[k]), 4))
    return "promote" if decision.promote else "reject"


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def register_op(
    target: str,
    tracking_uri: str,
    bootstrap_servers: str,
    governance_dir: str,
    gate_mode: str,
    decision: str,
    snapshot: Input[Dataset],
    challenger: Input[Model],
    report: Input[Artifact],
) -> str:
    """Register the challenger with lineage + shadow metrics; record its records in the lineage store."""
    import json
    from datetime import UTC, datetime
    from pathlib import Path

    from adaflash.components.steps import Snapshot
    from adaflash.governance.lineage import LineageStore
    from adaflash.models.targets import load_vocabulary
    from adaflash.registry.client import RegistryClient

    snap = Snapshot.load(Path(snapshot.path))
    shadow = json.loads(Path(report.path).read_text())
    lineage = {
        "shards": snap.shard_ids,
        "n_records": snap.lineage["train_records"],
        "tenants": snap.lineage["tenants"],
        "offsets": snap.lineage["offsets"],
        "train_record_ids": snap.lineage["train_record_ids"],
    }
    metrics = {"shadow": shadow["challenger"]["domains"], "champion": shadow["champion"]["domains"]}
    with RegistryClient(
        tracking_uri, load_vocabulary(target).fingerprint, bootstrap_servers=bootstrap_servers or None
    ) as reg:
        version = reg.register(
            Path(challenger.path),
            lineage=lineage,
            metrics=metrics,
            reason=f"pipeline run: shadow gate said {decision}: {'; '.join(shadow['gate']['reasons'])}",
            pending_approval=(gate_mode == "manual" and decision == "promote"),
        )
    store = LineageStore(Path(governance_dir) / "lineage.sqlite")
    store.mark_trained(
        snap.shard_ids, version, datetime.now(UTC).isoformat(), snap.lineage["train_record_ids"]
    )
    store.close()
    return version


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def promote_op(target: str, tracking_uri: str, bootstrap_servers: str, version: str, reason: str):
    """Auto-promotion: the challenger beat the champion in shadow evaluation."""
    from adaflash.models.targets import load_vocabulary
    from adaflash.registry.client import RegistryClient

    with RegistryClient(
        tracking_uri, load_vocabulary(target).fingerprint, bootstrap_servers=bootstrap_servers or None
    ) as reg:
        reg.promote(version, who="pipeline", reason=reason)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def record_run_op(governance_dir: str, status: dsl.PipelineTaskFinalStatus):
    """Exit handler: append the run's final state (and error, if any) to the pipeline run log."""
    import json
    import time
    from pathlib import Path

    entry = {
        "at": time.time(),
        "pipeline_job": status.pipeline_job_resource_name,
        "state": status.state,
        "error": status.error_message or None,
    }
    with open(Path(governance_dir) / "pipeline_runs.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
