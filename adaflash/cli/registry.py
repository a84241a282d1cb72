"""`adaflash registry ...`: drafter versions in MLflow — list, show, register, approve, promote,
roll back, the action history — and the embedded MLflow server (`registry server ...`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from adaflash.cli._common import (
    JsonOpt,
    TargetOpt,
    TrackingOpt,
    adaflash_home,
    console,
    option,
    shared_options,
)

app = typer.Typer()
registry_app = typer.Typer(
    no_args_is_help=True, help="Drafter versions in MLflow: list, approve, promote, roll back."
)
registry_server_app = typer.Typer(
    no_args_is_help=True, help="The embedded MLflow server (SQLite store, local artifacts) on loopback."
)
registry_app.add_typer(registry_server_app, name="server")
app.add_typer(registry_app, name="registry")

EventsBootstrapOpt = Annotated[
    str,
    typer.Option(
        "--bootstrap-servers",
        help="Kafka for adaflash.drafter.events ('' or unreachable: the action still happens, unpublished)",
    ),
]
WhoOpt = Annotated[
    str | None, typer.Option("--who", help="recorded as the actor (default $ADAFLASH_USER / login)")
]
ReasonOpt = Annotated[str, typer.Option("--reason", help="why: recorded with the action and in the event")]
VersionArg = Annotated[str, typer.Argument(help="version number or alias")]
OverrideOpt = Annotated[
    bool,
    typer.Option(
        "--override-gate",
        help="promote a version the shadow gate rejected (recorded as a manual override, with --reason)",
    ),
]
TRACKING = "http://127.0.0.1:5000"
EVENTS = "127.0.0.1:9092"


def registry_command(events: str | None):
    """--target, --tracking-uri and, unless `events` is None, --bootstrap-servers (default
    `events`, where the action's event is published): the command gets the client as `reg`."""
    opts = [option("target", TargetOpt, "smollm2"), option("tracking_uri", TrackingOpt, TRACKING)]
    if events is not None:
        opts.append(option("bootstrap_servers", EventsBootstrapOpt, events))
    return shared_options(_registry, opts)


def _registry(target: str, tracking_uri: str, bootstrap_servers: str = ""):
    from adaflash.models.checkpoint import checkpoint_check
    from adaflash.models.targets import load_vocabulary
    from adaflash.registry import RegistryClient

    vocab = load_vocabulary(target)  # the fingerprint without loading the weights
    return RegistryClient(
        tracking_uri,
        vocab.fingerprint,
        vocab.name,
        bootstrap_servers=bootstrap_servers or None,
        check_drafter=checkpoint_check(target, vocab),  # refuse what servers would refuse
    )


def _registry_server(port: int, state_dir: Path | None):
    from adaflash.registry import RegistryServer

    return RegistryServer(state_dir or adaflash_home() / "mlflow", port=port)


def _version_json(info) -> dict:
    return asdict(info) | {"created_at": info.created_at.isoformat()}


@registry_server_app.command("start")
def registry_server_start(
    port: Annotated[int, typer.Option(help="loopback port")] = 5000,
    state_dir: Annotated[
        Path | None, typer.Option(help="store + artifacts (default $ADAFLASH_HOME/mlflow)")
    ] = None,
) -> None:
    """Start MLflow (if not running): 1 worker, no job runners, SQLite + local artifacts."""
    st = _registry_server(port, state_dir).start()
    console.print(
        f"MLflow running: pid {st.pid} at {st.tracking_uri} (store {st.backend_store}, log {st.log})"
    )


@registry_server_app.command("stop")
def registry_server_stop(
    port: Annotated[int, typer.Option()] = 5000, state_dir: Annotated[Path | None, typer.Option()] = None
) -> None:
    """Stop the MLflow server started by `adaflash registry server start`."""
    console.print(
        "MLflow stopped" if _registry_server(port, state_dir).stop() else "no MLflow server was running"
    )


@registry_server_app.command("status")
def registry_server_status(
    port: Annotated[int, typer.Option()] = 5000, state_dir: Annotated[Path | None, typer.Option()] = None
) -> None:
    """Show whether the MLflow server is up (process alive and /health OK)."""
    st = _registry_server(port, state_dir).status()
    console.print_json(json.dumps(asdict(st)))
    if not st.running:
        raise typer.Exit(1)


@registry_app.command("list")
@registry_command(events="")
def registry_list(reg, as_json: JsonOpt = False) -> None:
    """Every drafter version of the target, newest first, with aliases, approval and shadow metrics."""
    versions = reg.versions()
    if as_json:
        console.print_json(json.dumps([_version_json(v) for v in versions]))
        return
    t = Table(title=f"{reg.model_name} (target {reg.target_name})")
    for col in ("version", "aliases", "status", "approval", "registered", "records", "metrics", "code"):
        t.add_column(col)
    for v in versions:
        metrics = ", ".join(f"{k}={val}" for k, val in sorted(v.metrics.items()))
        t.add_row(
            v.version,
            ", ".join(v.aliases),
            v.status,
            v.approval or "",
            v.created_at.strftime("%Y-%m-%d %H:%M"),
            v.lineage.get("records", ""),
            metrics,
            (v.code_version or "")[:12],
        )
    console.print(t)


@registry_app.command("show")
@registry_command(events="")
def registry_show(
    reg,
    version: Annotated[str, typer.Argument(help="version number or alias (champion, challenger, ...)")],
    as_json: JsonOpt = False,
) -> None:
    """One version: aliases, lineage, shadow metrics, code version, approvals and its action log."""
    info = reg.show(version)
    if as_json:
        console.print_json(json.dumps(_version_json(info)))
        return
    t = Table(title=f"{info.model_name} v{info.version}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    for k, v in (
        ("aliases", ", ".join(info.aliases)),
        ("status", info.status),
        ("approval", info.approval or ""),
        ("registered", info.created_at.isoformat(timespec="seconds")),
        ("source", info.source),
        ("code version", info.code_version or ""),
    ):
        t.add_row(k, v)
    for k, v in sorted(info.lineage.items()):
        t.add_row(f"lineage.{k}", v)
    for k, v in sorted(info.metrics.items()):
        t.add_row(f"metric.{k}", v)
    t.add_row("actions", info.description)
    console.print(t)


@registry_app.command("approve")
@registry_command(events=EVENTS)
def registry_approve(
    reg, version: VersionArg, reason: ReasonOpt, who: WhoOpt = None, override_gate: OverrideOpt = False
) -> None:
    """Approve a (pending) challenger and promote it to champion."""
    v = reg.approve(version, who, reason, override_gate=override_gate)
    console.print(f"approved and promoted {reg.model_name} v{v} to champion")


@registry_app.command("register")
@registry_command(events=EVENTS)
def registry_register(
    reg,
    drafter: Annotated[Path, typer.Argument(help="drafter directory (e.g. the bootstrap drafter)")],
    reason: ReasonOpt,
    promote: Annotated[bool, typer.Option(help="make it the champion right away (the first one)")] = False,
    who: WhoOpt = None,
) -> None:
    """Register a drafter directory as a new version (challenger); --promote makes it champion."""
    version = reg.register(drafter, lineage={"source": str(drafter)}, who=who, reason=reason)
    console.print(f"{reg.model_name} v{version} registered as challenger")
    if promote:
        reg.promote(version, who, reason)
        console.print(f"{reg.model_name} champion is now v{version}")


@registry_app.command("promote")
@registry_command(events=EVENTS)
def registry_promote(
    reg, version: VersionArg, reason: ReasonOpt, who: WhoOpt = None, override_gate: OverrideOpt = False
) -> None:
    """Make a version champion; the old champion becomes previous_champion. A version the shadow
    gate rejected needs --override-gate: the override and its reason are recorded."""
    ev = reg.promote(version, who, reason, override_gate=override_gate)
    old = f" (was v{ev.replaced_version})" if ev.replaced_version else ""
    from adaflash.registry.versions import OVERRIDE_REASON

    overrode = ev.reason.startswith(OVERRIDE_REASON)
    note = " — a manual override of the gate, recorded with its reason" if overrode else ""
    console.print(f"{reg.model_name} champion is now v{ev.version}{old}{note}")


@registry_app.command("rollback")
@registry_command(events=EVENTS)
def registry_rollback(reg, reason: ReasonOpt, who: WhoOpt = None) -> None:
    """Restore the previous champion; the demoted version is marked rolled_back."""
    ev = reg.rollback(who, reason)
    console.print(
        f"rolled back {reg.model_name}: champion is v{ev.version} again (v{ev.replaced_version} rolled back)"
    )


@registry_app.command("pending")
@registry_command(events=None)
def registry_pending(reg, as_json: JsonOpt = False) -> None:
    """Challengers waiting for a human approval."""
    pending = reg.pending_approvals()
    if as_json:
        console.print_json(json.dumps([_version_json(v) for v in pending]))
        return
    for v in pending:
        console.print(f"v{v.version}  {', '.join(v.aliases)}  metrics: {v.metrics}")
    if not pending:
        console.print("no version is pending approval")


@registry_app.command("sync")
@registry_command(events=EVENTS)
def registry_sync(reg) -> None:
    """Promote versions approved in the MLflow UI (tag adaflash.approval=approved)."""
    done = reg.sync_ui_approvals()
    console.print(f"promoted v{', v'.join(done)}" if done else "no new approvals in the MLflow UI")


@registry_app.command("history")
@registry_command(events=None)
def registry_history(reg, as_json: JsonOpt = False) -> None:
    """Every registry action, oldest first: who, when, why, and whether its event was published."""
    from adaflash.registry.reader import OUT_OF_BAND

    actions = reg.history()  # ends with an out_of_band line when the champion alias moved unrecorded
    if as_json:
        console.print_json(json.dumps([asdict(a) | {"at": a.at.isoformat()} for a in actions]))
        return
    t = Table(title=f"{reg.model_name} history")
    for col in ("when (UTC)", "action", "version", "replaced", "who", "reason", "event"):
        t.add_column(col)
    for a in actions:
        t.add_row(
            a.at.strftime("%Y-%m-%d %H:%M:%S"),
            f"[bold red]{a.action}[/]" if a.action == OUT_OF_BAND else a.action,
            a.version,
            a.replaced_version or "",
            a.who,
            a.reason,
            "published" if a.event_published else "not published",
        )
    console.print(t)


@registry_app.command("download")
@registry_command(events=None)
def registry_download(
    reg,
    version: Annotated[str, typer.Argument(help="version number or alias")] = "champion",
    out: Annotated[
        Path | None, typer.Option(help="directory (default $ADAFLASH_HOME/registry/downloads/...)")
    ] = None,
) -> None:
    """Fetch a version's drafter directory (DFlash format) for `adaflash serve --drafter`."""
    console.print(str(reg.download(version, out)))
