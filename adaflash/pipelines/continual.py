"""The continual-training pipeline (DESIGN §2), read top to bottom like the diagram:

    ingest → train (warm start from the champion) → shadow eval → register → gate → promote

In `auto` mode a challenger that beats the champion is promoted inside the run; in `manual` mode
the run ends with it registered as `challenger`, tagged pending approval, and a person promotes it
with `adaflash registry approve VERSION` or the approval tag in the MLflow UI — nothing blocks
inside the pipeline. An exit handler records every run's final state, failures included.

Two builds of the same pipeline (`adaflash pipeline compile --profile ...`):
  local       what kfp.local runs here and the local-kind overlay ships: no accelerator anywhere;
  production  train and shadow eval request one GPU each on GPU nodes (the train task runs the
              frozen target's feature extraction too: the trainer recomputes target supervision
              itself, DESIGN §1), and a training window larger than `max_records_per_gpu` trains
              data-parallel instead, as a PyTorchJob of `train_workers` GPU pods (`train_job_op`).
"""

from __future__ import annotations

from pathlib import Path

from kfp import compiler, dsl, kubernetes

from adaflash.components.cluster import GPU_NODE_SELECTOR, GPU_RESOURCE, GPU_TOLERATION, VOLUMES
from adaflash.components.gate import GATE_METRICS, GATE_MODES
from adaflash.components.kfp_components import (
    champion_op,
    ingest_op,
    promote_op,
    record_run_op,
    register_op,
    shadow_eval_op,
    train_job_op,
    train_op,
)
from adaflash.components.steps import LOSSES
from adaflash.pipelines.params import PROFILES, PipelineParams, Profile

__all__ = ["PROFILES", "PipelineParams", "Profile", "compile_pipeline", "continual_training", "run_local"]

PIPELINE_NAME = "adaflash-continual-training"
# Where `adaflash pipeline compile` writes each build: the local one is what manifests/pipelines
# ships (base and local-kind), the production overlay replaces it with its own.
IR_PATHS: dict[str, Path] = {
    "local": Path("manifests/pipelines/continual_training.yaml"),
    "production": Path("manifests/overlays/production/pipeline/continual_training.yaml"),
}


def _on_shared_volume(*tasks) -> None:
    # On a cluster every step mounts the volumes of manifests/base/storage.yaml where the governance
    # Deployment has them. kfp.local ignores this config.
    for t in tasks:
        for pvc, path in VOLUMES.items():
            kubernetes.mount_pvc(t, pvc_name=pvc, mount_path=path)


# The steps that publish DrafterEvents (register, promote) log in to Kafka on a cluster as the
# pipeline's KafkaUser (manifests/base/kafka-users.yaml: Write on adaflash.drafter.events), with
# the label the listener's network policy admits. All of it is Kubernetes config, which kfp.local
# ignores: local runs keep the embedded broker's plaintext.
KAFKA_USER = "adaflash-pipeline"
KAFKA_CLIENT_ENV = (
    "ADAFLASH_KAFKA_SECURITY_PROTOCOL",
    "ADAFLASH_KAFKA_SASL_MECHANISM",
    "ADAFLASH_KAFKA_SSL_CAFILE",
)


def _kafka_client(*tasks) -> None:
    for t in tasks:
        kubernetes.add_pod_label(t, "adaflash.io/kafka-client", "true")
        kubernetes.use_config_map_as_env(t, "kafka-client", {k: k for k in KAFKA_CLIENT_ENV})
        kubernetes.use_config_map_as_env(t, "kafka-client-pipeline", {"username": "ADAFLASH_KAFKA_USERNAME"})
        kubernetes.use_secret_as_env(t, KAFKA_USER, {"password": "ADAFLASH_KAFKA_PASSWORD"})
        kubernetes.use_secret_as_volume(t, "adaflash-cluster-ca-cert", mount_path="/etc/adaflash/kafka-ca")


def _on_one_gpu(*tasks) -> None:
    for t in tasks:
        t.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(1)
        for key, value in GPU_NODE_SELECTOR.items():
            kubernetes.add_node_selector(t, label_key=key, label_value=value)
        kubernetes.add_toleration(t, **GPU_TOLERATION.to_k8s())


def _gate_and_register(p: PipelineParams, snap, champ, challenger, gpu: bool) -> None:
    """shadow eval → register → gate → promote, for the challenger of either training path.

    The production build calls it once per branch rather than merging the branches'
    challengers with dsl.OneOf: kfp.local (2.17) fails on an artifact OneOf, while If/Else with
    each branch's own downstream tasks is what it runs."""
    shadow = shadow_eval_op(
        target=p.target,
        snapshot=snap.outputs["snapshot"],
        champion=champ.outputs["champion"],
        challenger=challenger,
        concurrency=p.concurrency,
        max_new_tokens=p.max_new_tokens,
        gamma=p.gamma,
        min_gain=p.min_gain,
        max_domain_regression=p.max_domain_regression,
        gate_metric=p.gate_metric,
        gate_min_records=p.gate_min_records,
    )
    reg = register_op(
        target=p.target,
        tracking_uri=p.tracking_uri,
        bootstrap_servers=p.bootstrap_servers,
        governance_dir=p.governance_dir,
        gate_mode=p.gate_mode,
        decision=shadow.outputs["Output"],
        snapshot=snap.outputs["snapshot"],
        challenger=challenger,
        report=shadow.outputs["report"],
    )
    _on_shared_volume(shadow, reg)
    _kafka_client(reg)
    if gpu:
        _on_one_gpu(shadow)
    with dsl.If(shadow.outputs["Output"] == "promote", name="challenger-wins"):
        with dsl.If(p.gate_mode == "auto", name="auto-promotion"):
            promoted = promote_op(
                target=p.target,
                tracking_uri=p.tracking_uri,
                bootstrap_servers=p.bootstrap_servers,
                version=reg.output,
                reason="shadow evaluation: the gate's paired bootstrap interval cleared the bar",
            )
            _kafka_client(promoted)


def _train_args(p: PipelineParams, snap, champ) -> dict:
    """What both training paths take: the snapshot, the champion and the recipe."""
    return {
        "target": p.target,
        "snapshot": snap.outputs["snapshot"],
        "champion": champ.outputs["champion"],
        "loss": p.loss,
        "epochs": p.epochs,
        "lr": p.lr,
        "random_anchors": p.random_anchors,
        "grad_accum": p.grad_accum,
    }


def _pipeline(p: PipelineParams, gpu: bool) -> None:
    """The pipeline, given its parameters (KFP's channels while it compiles)."""
    exit_task = record_run_op(governance_dir=p.governance_dir)
    _on_shared_volume(exit_task)
    with dsl.ExitHandler(exit_task, name="record-run"):
        snap = ingest_op(
            governance_dir=p.governance_dir,
            min_records=p.min_records,
            heldout_fraction=p.heldout_fraction,
            heldout_per_domain=p.heldout_per_domain,
            replay_records=p.replay_records,
            replay_half_life_s=p.replay_half_life_s,
            replay_tenant_cap=p.replay_tenant_cap,
        )
        champ = champion_op(target=p.target, tracking_uri=p.tracking_uri, fallback_drafter=p.fallback_drafter)
        _on_shared_volume(snap, champ)
        train_args = _train_args(p, snap, champ)
        if not gpu:
            trained = train_op(**train_args)
            _on_shared_volume(trained)
            _gate_and_register(p, snap, champ, trained.outputs["challenger"], gpu)
            return
        # The window's size is known only once ingest has run: branch on it at run time.
        with dsl.If(snap.outputs["Output"] > p.max_records_per_gpu, name="data-parallel"):
            job = train_job_op(
                **train_args,
                governance_dir=p.governance_dir,
                train_workers=p.train_workers,
                train_namespace=p.train_namespace,
                train_timeout_minutes=p.train_timeout_minutes,
            )
            _on_shared_volume(job)  # it stages the inputs on governance-data for the job's pods
            _gate_and_register(p, snap, champ, job.outputs["challenger"], gpu)
        with dsl.Else(name="one-gpu"):
            trained = train_op(**train_args)
            _on_shared_volume(trained)
            _on_one_gpu(trained)
            _gate_and_register(p, snap, champ, trained.outputs["challenger"], gpu)


def _build(profile: Profile):
    """One build: a pipeline function whose typed signature is `PipelineParams.signature(profile)`."""
    gpu = profile == "production"

    def pipeline(*args):  # no docstring: KFP would make it the pipeline's description
        _pipeline(PipelineParams.of(profile, args), gpu)

    pipeline.__signature__ = PipelineParams.signature(profile)
    pipeline.__name__ = "continual_training_production" if gpu else "continual_training"
    description = "OPD retraining of the served drafter with a shadow-eval gate"
    if gpu:
        description += " (GPU; data-parallel past one GPU)"
    return dsl.pipeline(name=PIPELINE_NAME, description=description)(pipeline)


continual_training = _build("local")
continual_training_production = _build("production")
PIPELINES = {"local": continual_training, "production": continual_training_production}


def run_local(pipeline_root: Path, params: PipelineParams) -> None:
    """Execute the pipeline here through kfp.local: every component is a subprocess of this
    environment. Raises when a task fails (after the exit handler has recorded the run)."""
    from kfp import local

    if params.loss not in LOSSES:
        raise ValueError(f"unknown loss {params.loss!r}: choose opd, osd or fkl")
    if params.gate_mode not in GATE_MODES:
        raise ValueError("gate mode must be auto or manual")
    if params.gate_metric not in GATE_METRICS:
        raise ValueError(f"gate metric must be one of {', '.join(GATE_METRICS)}")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root.resolve()))
    continual_training(**params.arguments("local"))


def compile_pipeline(path: Path | None = None, profile: Profile = "local") -> Path:
    """Write the IR of one build (`path` defaults to where the manifests expect it)."""
    if profile not in PIPELINES:
        raise ValueError(f"unknown profile {profile!r}: choose {' or '.join(PROFILES)}")
    path = path or IR_PATHS[profile]
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(PIPELINES[profile], str(path))
    return path
