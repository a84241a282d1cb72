"""`adaflash pipeline ...`: compile the continual-training pipeline, run it locally (kfp.local),
schedule it on a Kubeflow cluster, or watch the buffer and run it when enough data arrived; and
`train-step`, the train step as a command of its own (each rank of a data-parallel PyTorchJob)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from adaflash.cli._common import BootstrapOpt, GovDirOpt, TargetOpt, console, governance_state
from adaflash.errors import InputError
from adaflash.pipelines.params import PipelineParams

app = typer.Typer()
pipeline_app = typer.Typer(
    no_args_is_help=True, help="The continual-training pipeline (Kubeflow Pipelines v2)."
)
app.add_typer(pipeline_app, name="pipeline")


@pipeline_app.command("compile")
def pipeline_compile(
    profile: Annotated[
        str,
        typer.Option(
            help="local: no accelerator (kfp.local, local-kind); production: GPU train + shadow eval, "
            "data-parallel PyTorchJob past max_records_per_gpu"
        ),
    ] = "local",
    out: Annotated[
        Path | None,
        typer.Option(help="IR YAML to write [default: where the manifests expect the profile's IR]"),
    ] = None,
) -> None:
    """Compile the pipeline to KFP IR YAML (both profiles committed; CI checks them for drift)."""
    from adaflash.pipelines.continual import compile_pipeline

    try:
        console.print(f"wrote {compile_pipeline(out, profile)}")  # type: ignore[arg-type]
    except ValueError as e:
        raise InputError(str(e)) from e


@pipeline_app.command("train-step")
def pipeline_train_step(
    snapshot: Annotated[Path, typer.Option(help="snapshot directory (what the ingest step wrote)")],
    champion: Annotated[Path, typer.Option(help="drafter directory to warm-start from")],
    out: Annotated[Path, typer.Option(help="challenger directory to write")],
    target: TargetOpt = "smollm2",
    recipe: Annotated[
        Path | None,
        typer.Option(help="OnlineConfig as JSON (a PyTorchJob's recipe.json) [default: defaults]"),
    ] = None,
    parent: Annotated[str, typer.Option(help="the champion's registry version, for lineage")] = "",
) -> None:
    """The pipeline's train step on its own. Under `torchrun --nproc-per-node N` it trains
    data-parallel (NCCL on GPUs, gloo on CPUs) with the same global batch; rank 0 writes."""
    import json
    import os

    from adaflash.components.steps import train_process
    from adaflash.training.online import OnlineConfig

    cfg = OnlineConfig(**json.loads(recipe.read_text())) if recipe else OnlineConfig()
    summary = train_process(target, snapshot, champion, parent or None, out, cfg)
    if os.environ.get("RANK", "0") == "0":  # torchrun's global rank: one line per job, not per rank
        console.print(f"challenger in {out}: {summary}")


# The options' defaults are the pipeline's (pipelines/params.py); `P.NAME` is a field's default.
P = PipelineParams


@pipeline_app.command("run")
def pipeline_run(
    target: TargetOpt = "smollm2",
    fallback_drafter: Annotated[
        Path, typer.Option(help="champion to warm-start from until the registry has one")
    ] = Path("drafters/smollm2"),
    tracking_uri: Annotated[
        str, typer.Option(help="MLflow tracking/registry server")
    ] = "http://127.0.0.1:5000",
    bootstrap_servers: BootstrapOpt = P.bootstrap_servers,
    data_dir: GovDirOpt = None,
    min_records: Annotated[int, typer.Option(help="new clean records a run needs")] = P.min_records,
    loss: Annotated[str, typer.Option(help="opd | osd | fkl")] = P.loss,
    epochs: Annotated[int, typer.Option()] = P.epochs,
    gate_mode: Annotated[
        str, typer.Option(help="auto: promote a winner; manual: leave it pending approval")
    ] = P.gate_mode,
    heldout_per_domain: Annotated[
        int, typer.Option(help="held-out records per domain for the gate (0: --heldout-fraction of all)")
    ] = P.heldout_per_domain,
    heldout_fraction: Annotated[
        float, typer.Option(help="held-out share when no per-domain count")
    ] = P.heldout_fraction,
    replay_records: Annotated[
        int, typer.Option(help="earlier clean records replayed beside the new ones (0: new only)")
    ] = P.replay_records,
    replay_half_life_s: Annotated[
        float, typer.Option(help="replay recency: a record's weight halves per this age (seconds)")
    ] = P.replay_half_life_s,
    replay_tenant_cap: Annotated[
        float, typer.Option(help="the most of the window one tenant fills")
    ] = P.replay_tenant_cap,
    min_gain: Annotated[
        float, typer.Option(help="the gate's overall interval must lie above this τ gain (tokens/round)")
    ] = P.min_gain,
    gate_min_records: Annotated[
        int, typer.Option(help="fewer paired held-out records: reject")
    ] = P.gate_min_records,
    gate_metric: Annotated[
        str, typer.Option(help="tau_full (full-block τ; served τ guarded) | tau (served)")
    ] = P.gate_metric,
    concurrency: Annotated[int, typer.Option(help="shadow-eval concurrency")] = P.concurrency,
    gamma: Annotated[
        float, typer.Option(help="shadow-eval k̂ = ⌊γ·â·k⌋: the fleet's `serve --gamma`")
    ] = P.gamma,
    max_new_tokens: Annotated[int, typer.Option(help="shadow-eval output length")] = P.max_new_tokens,
    pipeline_root: Annotated[Path, typer.Option(help="kfp.local artifacts")] = Path(".adaflash/kfp"),
) -> None:
    """Run the pipeline locally through kfp.local (every component in this environment)."""
    from adaflash.pipelines.continual import run_local

    gov = governance_state(data_dir).resolve()
    params = PipelineParams(
        target=target,
        governance_dir=str(gov),
        tracking_uri=tracking_uri,
        fallback_drafter=str(fallback_drafter.resolve()),
        bootstrap_servers=bootstrap_servers,
        min_records=min_records,
        loss=loss,
        epochs=epochs,
        gate_mode=gate_mode,
        gate_metric=gate_metric,
        min_gain=min_gain,
        gate_min_records=gate_min_records,
        heldout_per_domain=heldout_per_domain,
        heldout_fraction=heldout_fraction,
        replay_records=replay_records,
        replay_half_life_s=replay_half_life_s,
        replay_tenant_cap=replay_tenant_cap,
        concurrency=concurrency,
        max_new_tokens=max_new_tokens,
        gamma=gamma,
    )
    try:
        run_local(pipeline_root, params)
    except ValueError as e:
        raise InputError(str(e)) from e
    console.print(f"pipeline finished; run log: {gov / 'pipeline_runs.jsonl'}")


@pipeline_app.command("schedule")
def pipeline_schedule(
    host: Annotated[str, typer.Option(help="Kubeflow Pipelines API endpoint (ml-pipeline-ui / ml-pipeline)")],
    target: Annotated[str, typer.Option(help="target as the pipeline pods see it")] = "/models/target",
    cron: Annotated[str, typer.Option(help="KFP cron with seconds field")] = "0 0 2 * * *",
    governance_dir: Annotated[
        str, typer.Option(help="governance dir as mounted in the cluster")
    ] = "/data/governance",
    tracking_uri: Annotated[str, typer.Option(help="MLflow as seen from the cluster")] = "http://mlflow:5000",
    fallback_drafter: Annotated[
        str, typer.Option(help="used until the registry has a champion")
    ] = "/data/governance/drafters/bootstrap",
    bootstrap_servers: BootstrapOpt = "kafka:9092",
    gate_mode: Annotated[str, typer.Option(help="auto | manual")] = "manual",
) -> None:
    """Create a recurring run of the committed IR on a Kubeflow cluster (kfp.Client)."""
    from adaflash.pipelines.schedule import schedule_recurring_run

    params = PipelineParams(
        target=target,
        governance_dir=governance_dir,
        tracking_uri=tracking_uri,
        fallback_drafter=fallback_drafter,
        bootstrap_servers=bootstrap_servers,
        gate_mode=gate_mode,
    )
    # What was given; the IR's defaults (the same PipelineParams) fill in the rest on the cluster.
    rid = schedule_recurring_run(host, params.arguments(changed_only=True), cron=cron)
    console.print(f"recurring run {rid} created ({cron})")


@pipeline_app.command("watch")
def pipeline_watch(
    target: TargetOpt = "smollm2",
    data_dir: GovDirOpt = None,
    min_records: Annotated[int, typer.Option()] = P.min_records,
    interval: Annotated[float, typer.Option(help="seconds between checks")] = 60.0,
    max_runs: Annotated[int | None, typer.Option(help="stop after this many runs")] = None,
    tracking_uri: Annotated[str, typer.Option()] = "http://127.0.0.1:5000",
    bootstrap_servers: BootstrapOpt = "",
    fallback_drafter: Annotated[Path, typer.Option()] = Path("drafters/smollm2"),
) -> None:
    """Run the pipeline locally whenever enough new clean records exist."""
    from adaflash.pipelines.schedule import watch

    gov = governance_state(data_dir)

    def run() -> None:
        pipeline_run(
            target=target, fallback_drafter=fallback_drafter, tracking_uri=tracking_uri,
            bootstrap_servers=bootstrap_servers, data_dir=gov, min_records=min_records,
        )  # fmt: skip

    watch(gov, min_records, run, interval, max_runs, log=lambda m: print(m, flush=True))
