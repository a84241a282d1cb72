"""`adaflash broker ...`, `governance ...` and `lineage ...`: the feedback bus, the governance
service that turns raw feedback into the clean buffer, and the lineage store that answers for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from adaflash.cli._common import (
    BootstrapOpt,
    GovDirOpt,
    PromptsDirOpt,
    TargetOpt,
    adaflash_home,
    console,
    err_console,
    governance_state,
)
from adaflash.errors import InputError

app = typer.Typer()
broker_app = typer.Typer(no_args_is_help=True, help="The embedded Kafka broker (Tansu) on loopback.")
governance_app = typer.Typer(
    no_args_is_help=True, help="Scrub, validate and filter feedback into the buffer."
)
lineage_app = typer.Typer(no_args_is_help=True, help="Where records went, why, and what they trained.")
app.add_typer(broker_app, name="broker")
app.add_typer(governance_app, name="governance")
app.add_typer(lineage_app, name="lineage")

BrokerPortQuery = Annotated[
    int | None, typer.Option("--port", help="default: the port `broker start` used, else 9092")
]


def _broker(port: int | None):
    """The broker of $ADAFLASH_HOME; without --port, on the port it was started on (its pid file)."""
    from adaflash.feedback.broker import Broker

    state = adaflash_home() / "broker"
    if port is None:
        try:
            port = int(json.loads((state / "broker.json").read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError):
            port = 9092
    return Broker(state, port=port)


@broker_app.command("start")
def broker_start(port: Annotated[int, typer.Option(help="loopback port")] = 9092) -> None:
    """Start Tansu (if not running) and create the AdaFlash topics."""
    st = _broker(port).start()
    console.print(f"broker running: pid {st['pid']} on {st['bootstrap_servers']} (log {st['log']})")
    console.print("[dim]topics live in memory: a broker restart loses them (production runs Kafka)[/]")


@broker_app.command("stop")
def broker_stop(port: BrokerPortQuery = None) -> None:
    """Stop the broker started by `adaflash broker start`."""
    console.print("broker stopped" if _broker(port).stop() else "no broker was running")


@broker_app.command("status")
def broker_status(port: BrokerPortQuery = None) -> None:
    """Show whether the broker is up, and its topics."""
    st = _broker(port).status()
    if st["running"]:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=st["bootstrap_servers"])  # embedded: plaintext
        st["topics"] = sorted(admin.list_topics())
        admin.close()
    console.print_json(json.dumps(st))
    if not st["running"]:
        raise typer.Exit(1)


@governance_app.command("run")
def governance_run(
    target: TargetOpt = "smollm2",
    bootstrap_servers: BootstrapOpt = "127.0.0.1:9092",
    data_dir: GovDirOpt = None,
    batch_size: Annotated[int, typer.Option(help="records per batch (one audit entry each)")] = 256,
    max_batches: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
    idle_exit: Annotated[float | None, typer.Option(help="stop after this many idle seconds")] = None,
) -> None:
    """Consume adaflash.feedback.raw; write clean shards, the clean/quarantine topics and the audit."""
    from adaflash.governance.governor import GovernanceConfig, Governor
    from adaflash.governance.service import GovernanceService
    from adaflash.models.targets import load_vocabulary

    cfg = GovernanceConfig(
        data_dir=governance_state(data_dir), bootstrap_servers=bootstrap_servers, batch_size=batch_size
    )
    with err_console.status("loading tokenizer, Presidio + spaCy and the GX suite..."):
        gov = Governor(cfg, load_vocabulary(target))
    svc = GovernanceService(cfg, gov)

    def show(a) -> None:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(a.reasons.items())) or "-"
        print(
            f"batch {a.batch_id[:8]}: in={a.n_in} clean={a.n_clean} quarantined={a.n_quarantined} "
            f"duplicate={a.n_duplicate} reasons: {reasons} ({a.seconds:.1f}s)",
            flush=True,
        )

    try:
        n = svc.run(max_batches=max_batches, idle_exit_s=idle_exit, on_batch=show)
    finally:
        svc.close()
    console.print(f"governed {n} batches into {cfg.data_dir}")


@governance_app.command("bench")
def governance_bench(
    target: TargetOpt = "smollm2",
    records: Annotated[int, typer.Option(help="synthetic records (~300 tokens of prompt+output each)")] = 600,
    batch_size: Annotated[int, typer.Option()] = 200,
    out: Annotated[Path, typer.Option(help="writes governance_bench.json/.md/.png here")] = Path(
        "benchmarks/governance"
    ),
    data_dir: PromptsDirOpt = None,
    workers: Annotated[int, typer.Option(help="also measure N governance processes side by side")] = 2,
    pii: Annotated[
        str, typer.Option(help="PII layers: both (default) | presidio (context boost) | legacy (issue 4)")
    ] = "both",
    quality: Annotated[bool, typer.Option(help="also measure false positives on the PII-free sets")] = True,
) -> None:
    """Measure governance records/s on this machine and where the time goes (vs raw spaCy)."""
    from adaflash.bench.governance import run_bench

    run_bench(target, records, batch_size, out, data_dir, console, workers, pii=pii, quality=quality)


def _lineage(data_dir: Path | None):
    from adaflash.governance.config import GovernanceConfig
    from adaflash.governance.lineage import LineageStore

    path = GovernanceConfig(governance_state(data_dir)).lineage_path
    if not path.exists():
        raise InputError(
            f"no lineage store at {path}: run `adaflash governance run` first or pass --data-dir"
        )
    return LineageStore(path)


def _print_found(row: dict | None, what: str) -> None:
    if row is None:
        raise InputError(f"{what} is not in the lineage store")
    console.print_json(json.dumps(row))


@lineage_app.command("record")
def lineage_record(record_id: str, data_dir: GovDirOpt = None) -> None:
    """Clean or quarantined (and why), which shard, which drafter versions trained on it."""
    _print_found(_lineage(data_dir).record(record_id), f"record {record_id}")


@lineage_app.command("shard")
def lineage_shard(shard_id: str, data_dir: GovDirOpt = None) -> None:
    """A buffer shard: tenant, date, record count, the batch that wrote it, versions it trained."""
    _print_found(_lineage(data_dir).shard(shard_id), f"shard {shard_id}")


@lineage_app.command("tenant")
def lineage_tenant(tenant_id: str, data_dir: GovDirOpt = None) -> None:
    """A tenant's clean/quarantined counts and quarantine reasons."""
    console.print_json(json.dumps(_lineage(data_dir).tenant(tenant_id)))


@lineage_app.command("audit")
def lineage_audit(
    data_dir: GovDirOpt = None, last: Annotated[int, typer.Option(help="most recent batches")] = 10
) -> None:
    """The governance audit log: per batch offsets, in/clean/quarantined/duplicate, reasons, PII types."""
    store = _lineage(data_dir)
    t = Table(title=f"governance audit — totals {store.totals()}")
    for col in ("batch", "finished", "offsets", "in", "clean", "quar.", "dup.", "reasons", "PII scrubbed"):
        t.add_column(col)
    for a in store.audit(last):
        offs = ", ".join(f"{k.rsplit('.', 1)[-1]}:{v[0]}-{v[1]}" for k, v in sorted(a["offsets"].items()))
        t.add_row(
            a["batch_id"][:8],
            a["finished_at"][:19],
            offs,
            str(a["n_in"]),
            str(a["n_clean"]),
            str(a["n_quarantined"]),
            str(a["n_duplicate"]),
            ", ".join(f"{k}={v}" for k, v in sorted(a["reasons"].items())),
            ", ".join(f"{k}={v}" for k, v in sorted(a["pii_entities"].items())),
        )
    console.print(t)
