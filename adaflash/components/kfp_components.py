"""KFP v2 lightweight components: typed artifacts around `adaflash.components.steps`.

Each body only moves artifacts (paths in, metadata and metrics out) and calls one step, so the
tests of `steps` test what the pipeline runs. Bodies import what they need (KFP ships only the
function's source to the executor). Locally they run through
`kfp.local.SubprocessRunner(use_venv=False)` in this environment; on a cluster they run in
`IMAGE` (components/cluster.py), which is this package installed (see manifests/). An input
that carries a pipeline parameter has its name and type (pipelines/params.py: PipelineParams).
"""

# No `from __future__ import annotations`: KFP reads the real annotation objects (Input[Dataset]...).
from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from adaflash.components.cluster import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def ingest_op(
    governance_dir: str,
    min_records: int,
    heldout_fraction: float,
    heldout_per_domain: int,
    replay_records: int,
    replay_half_life_s: float,
    replay_tenant_cap: float,
    snapshot: Output[Dataset],
) -> int:
    """Clean records no version trained on (+ a replay window of earlier ones) → train/held-out
    snapshot with lineage."""
    from pathlib import Path

    from adaflash.components.ingest import ingest
    from adaflash.training.replay import ReplayWindow

    window = ReplayWindow(replay_records, replay_half_life_s, replay_tenant_cap)
    snap = ingest(Path(governance_dir), min_records=min_records, heldout_fraction=heldout_fraction,
                  heldout_per_domain=heldout_per_domain, replay=window)  # fmt: skip
    snap.save(Path(snapshot.path))
    snapshot.metadata.update(snap.summary())
    return len(snap.train)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def champion_op(target: str, tracking_uri: str, fallback_drafter: str, champion: Output[Model]) -> str:
    """The registry's champion (or the bootstrap drafter before the first promotion)."""
    from pathlib import Path

    from adaflash.components.steps import champion as fetch_champion

    champ = fetch_champion(target, tracking_uri, fallback_drafter, Path(champion.path))
    champion.metadata["version"] = champ.source
    return champ.version


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train_op(
    target: str,
    snapshot: Input[Dataset],
    champion: Input[Model],
    loss: str,
    epochs: int,
    lr: float,
    random_anchors: int,
    grad_accum: int,
    challenger: Output[Model],
):
    """Warm-start from the champion; OPD (or osd / fkl) on the snapshot's training records, in
    this process, on its GPU when it has one (the target's forward for the teacher and the
    drafter's context features runs here too)."""
    from pathlib import Path

    from adaflash.components.ingest import Snapshot
    from adaflash.components.steps import step_target, train
    from adaflash.training.online import OnlineConfig

    cfg = OnlineConfig(loss=loss, epochs=epochs, lr=lr, random_anchors=random_anchors, grad_accum=grad_accum)
    summary = train(step_target(target), Snapshot.load(Path(snapshot.path)), Path(champion.path),
                    champion.metadata.get("version"), Path(challenger.path), cfg)  # fmt: skip
    challenger.metadata.update(summary)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train_job_op(
    target: str,
    snapshot: Input[Dataset],
    champion: Input[Model],
    loss: str,
    epochs: int,
    lr: float,
    random_anchors: int,
    grad_accum: int,
    governance_dir: str,
    train_workers: int,
    train_namespace: str,
    train_timeout_minutes: int,
    challenger: Output[Model],
):
    """The same training, data-parallel: a PyTorchJob of `train_workers` GPU pods running `torchrun`
    (components/trainjob.py). This task only stages the inputs on the shared volume, submits the
    job, waits for it and collects the challenger; it needs no GPU itself."""
    from pathlib import Path

    from adaflash.components.trainjob import TrainJob, run_train_job
    from adaflash.training.online import OnlineConfig

    cfg = OnlineConfig(loss=loss, epochs=epochs, lr=lr, random_anchors=random_anchors, grad_accum=grad_accum)
    job = TrainJob.for_inputs(target, Path(snapshot.path), champion.metadata.get("version"), cfg,
                              Path(governance_dir), train_workers, train_namespace)  # fmt: skip
    summary = run_train_job(job, Path(snapshot.path), Path(champion.path), Path(challenger.path),
                            timeout_s=train_timeout_minutes * 60)  # fmt: skip
    challenger.metadata.update(summary)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def shadow_eval_op(
    target: str,
    snapshot: Input[Dataset],
    champion: Input[Model],
    challenger: Input[Model],
    concurrency: int,
    max_new_tokens: int,
    gamma: float,
    min_gain: float,
    max_domain_regression: float,
    gate_metric: str,
    gate_min_records: int,
    report: Output[Artifact],
    metrics: Output[Metrics],
) -> str:
    """Challenger vs champion on held-out recent traffic; returns "promote" or "reject"."""
    import json
    from pathlib import Path

    from adaflash.components.gate import GatePolicy
    from adaflash.components.ingest import Snapshot
    from adaflash.components.steps import shadow_gate
    from adaflash.models.targets import load_target

    policy = GatePolicy(min_gain=min_gain, max_domain_regression=max_domain_regression, metric=gate_metric,
                        min_records=gate_min_records)  # fmt: skip
    held = Snapshot.load(Path(snapshot.path)).heldout
    # On the CPU even on its GPU node: the serving engine it measures creates its tensors on the
    # CPU (only training is device-clean so far, tests/test_device.py).
    shadow = shadow_gate(load_target(target), held, Path(champion.path), Path(challenger.path), policy,
                         concurrency, max_new_tokens, gamma)  # fmt: skip
    Path(report.path).write_text(json.dumps(shadow.to_dict()))
    for name, value in shadow.metrics().items():
        metrics.log_metric(name, value)
    return "promote" if shadow.decision.promote else "reject"


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
    from pathlib import Path

    from adaflash.components.ingest import Snapshot
    from adaflash.components.steps import register

    return register(target, tracking_uri, bootstrap_servers, Path(governance_dir), gate_mode, decision,
                    Snapshot.load(Path(snapshot.path)), Path(challenger.path),
                    json.loads(Path(report.path).read_text()), dict(challenger.metadata))  # fmt: skip


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def promote_op(target: str, tracking_uri: str, bootstrap_servers: str, version: str, reason: str):
    """Auto-promotion: the challenger beat the champion in shadow evaluation."""
    from adaflash.components.steps import promote

    promote(target, tracking_uri, bootstrap_servers, version, reason)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def record_run_op(governance_dir: str, status: dsl.PipelineTaskFinalStatus):
    """Exit handler: append the run's final state (and error, if any) to the pipeline run log."""
    from pathlib import Path

    from adaflash.components.steps import record_run

    record_run(Path(governance_dir), status.pipeline_job_resource_name, status.state, status.error_message)
