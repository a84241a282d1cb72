"""The continual-training pipeline (DESIGN §2), read top to bottom like the diagram:

    ingest → train (warm start from the champion) → shadow eval → register → gate → promote

In `auto` mode a challenger that beats the champion is promoted inside the run; in `manual` mode
the run ends with it registered as `challenger`, tagged pending approval, and a person promotes it
with `adaflash registry approve VERSION` or the approval tag in the MLflow UI — nothing blocks
inside the pipeline. An exit handler records every run's final state, failures included.
"""

# No `from __future__ import annotations`: KFP reads the parameters' real annotation objects.
from pathlib import Path

from kfp import compiler, dsl, kubernetes

from adaflash.components.gate import GATE_METRICS, GATE_MODES
from adaflash.components.kfp_components import (
    champion_op,
    ingest_op,
    promote_op,
    record_run_op,
    register_op,
    shadow_eval_op,
    train_op,
)
from adaflash.components.steps import LOSSES

PIPELINE_NAME = "adaflash-continual-training"
# On a cluster every step mounts the volumes of manifests/base/storage.yaml where the governance
# Deployment has them: the buffer + lineage store, and the target. kfp.local ignores this config.
VOLUMES = {"governance-data": "/data/governance", "target-model": "/models/target"}


def _on_shared_volume(*tasks) -> None:
    for t in tasks:
        for pvc, path in VOLUMES.items():
            kubernetes.mount_pvc(t, pvc_name=pvc, mount_path=path)


@dsl.pipeline(name=PIPELINE_NAME, description="OPD retraining of the served drafter with a shadow-eval gate")
def continual_training(
    target: str,
    governance_dir: str,
    tracking_uri: str,
    fallback_drafter: str,
    bootstrap_servers: str = "",
    min_records: int = 128,
    heldout_fraction: float = 0.2,
    heldout_per_domain: int = 0,
    loss: str = "opd",
    epochs: int = 2,
    lr: float = 3e-4,
    random_anchors: int = 0,
    concurrency: int = 8,
    max_new_tokens: int = 64,
    gamma: float = 1.0,
    min_gain: float = 0.0,
    max_domain_regression: float = 0.02,
    gate_metric: str = "tau_full",
    gate_min_records: int = 16,
    gate_mode: str = "auto",
):
    exit_task = record_run_op(governance_dir=governance_dir)
    _on_shared_volume(exit_task)
    with dsl.ExitHandler(exit_task, name="record-run"):
        snap = ingest_op(
            governance_dir=governance_dir,
            min_records=min_records,
            heldout_fraction=heldout_fraction,
            heldout_per_domain=heldout_per_domain,
        )
        champ = champion_op(target=target, tracking_uri=tracking_uri, fallback_dir=fallback_drafter)
        trained = train_op(
            target=target,
            snapshot=snap.outputs["snapshot"],
            champion=champ.outputs["champion"],
            loss=loss,
            epochs=epochs,
            lr=lr,
            random_anchors=random_anchors,
        )
        shadow = shadow_eval_op(
            target=target,
            snapshot=snap.outputs["snapshot"],
            champion=champ.outputs["champion"],
            challenger=trained.outputs["challenger"],
            concurrency=concurrency,
            max_new_tokens=max_new_tokens,
            gamma=gamma,
            min_gain=min_gain,
            max_domain_regression=max_domain_regression,
            gate_metric=gate_metric,
            gate_min_records=gate_min_records,
        )
        reg = register_op(
            target=target,
            tracking_uri=tracking_uri,
            bootstrap_servers=bootstrap_servers,
            governance_dir=governance_dir,
            gate_mode=gate_mode,
            decision=shadow.outputs["Output"],
            snapshot=snap.outputs["snapshot"],
            challenger=trained.outputs["challenger"],
            report=shadow.outputs["report"],
        )
        _on_shared_volume(snap, champ, trained, shadow, reg)
        with dsl.If(shadow.outputs["Output"] == "promote", name="challenger-wins"):
            with dsl.If(gate_mode == "auto", name="auto-promotion"):
                promote_op(
                    target=target,
                    tracking_uri=tracking_uri,
                    bootstrap_servers=bootstrap_servers,
                    version=reg.output,
                    reason="shadow evaluation: the gate's paired bootstrap interval cleared the bar",
                )


def run_local(pipeline_root: Path, **params) -> None:
    """Execute the pipeline here through kfp.local: every component is a subprocess of this
    environment. Raises when a task fails (after the exit handler has recorded the run)."""
    from kfp import local

    if params.get("loss", "opd") not in LOSSES:
        raise ValueError(f"unknown loss {params['loss']!r}: choose opd, osd or fkl")
    if params.get("gate_mode", "auto") not in GATE_MODES:
        raise ValueError("gate mode must be auto or manual")
    if params.get("gate_metric", "tau_full") not in GATE_METRICS:
        raise ValueError(f"gate metric must be one of {', '.join(GATE_METRICS)}")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root.resolve()))
    continual_training(**params)


def compile_pipeline(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(continual_training, str(path))
    return path
