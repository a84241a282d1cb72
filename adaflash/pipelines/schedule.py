"""Recurring runs on a Kubeflow Pipelines cluster, and the local "enough new data" trigger."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from adaflash.governance.config import GovernanceConfig
from adaflash.governance.lineage import LineageStore

PIPELINE_IR = Path("manifests/pipelines/continual_training.yaml")


def schedule_recurring_run(
    host: str,
    params: dict,
    cron: str = "0 0 2 * * *",  # KFP crons have seconds: daily at 02:00
    experiment: str = "adaflash",
    job_name: str = "adaflash-continual-training",
    ir: Path = PIPELINE_IR,
    existing_token: str | None = None,
) -> str:
    """Create (or reuse) the experiment and a recurring run of the compiled IR; returns its id.

    One run at a time (`max_concurrency=1`) and no catch-up: a cluster that was down overnight
    runs once when it is back, not once per missed slot.
    """
    import kfp

    client = kfp.Client(host=host, existing_token=existing_token)
    try:
        exp = client.get_experiment(experiment_name=experiment)
    except Exception:  # noqa: BLE001 - kfp raises ValueError or ApiException for "not found"
        exp = client.create_experiment(experiment)
    run = client.create_recurring_run(
        experiment_id=exp.experiment_id,
        job_name=job_name,
        cron_expression=cron,
        pipeline_package_path=str(ir),
        params=params,
        max_concurrency=1,
        no_catchup=True,
        enabled=True,
    )
    return run.recurring_run_id


def new_clean_records(governance_dir: Path) -> int:
    """Clean records in shards that no drafter version has consumed yet."""
    path = GovernanceConfig(governance_dir).lineage_path
    if not path.exists():
        return 0
    store = LineageStore(path)
    try:
        return sum(s["n_records"] for s in store.untrained_shards())
    finally:
        store.close()


def watch(
    governance_dir: Path,
    min_records: int,
    run: Callable[[], None],
    interval_s: float = 60.0,
    max_runs: int | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """Start a pipeline run whenever ≥ `min_records` new clean records exist; returns runs started."""
    runs = 0
    while max_runs is None or runs < max_runs:
        n = new_clean_records(governance_dir)
        if n >= min_records:
            log(f"{n} new clean records (≥ {min_records}): starting a pipeline run")
            run()
            runs += 1
            continue
        log(f"{n} new clean records; waiting for {min_records}")
        time.sleep(interval_s)
    return runs
