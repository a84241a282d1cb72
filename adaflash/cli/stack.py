"""`adaflash up`, `down`, `status` and `demo`: the embedded stack on one machine, and the whole
loop run once end to end."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from adaflash.cli._common import (
    JsonOpt,
    TargetOpt,
    adaflash_home,
    console,
    err_console,
    option,
    setup_torch,
    shared_options,
)
from adaflash.errors import InputError

app = typer.Typer()

BrokerPortOpt = Annotated[int, typer.Option(help="Kafka (Tansu) port")]
RegistryPortOpt = Annotated[int, typer.Option(help="MLflow port")]
ServePortOpt = Annotated[int, typer.Option(help="OpenAI API port")]


def _stack(target: str, drafter: Path | None, broker_port: int, registry_port: int, port: int, watch: bool,
           min_records: int, max_restarts: int = 5, restart_window: float = 300.0):  # fmt: skip
    from adaflash.ops.stack import Stack, StackConfig
    from adaflash.ops.supervisor import RestartPolicy

    return Stack(
        StackConfig(
            home=adaflash_home().resolve(),
            target=target,
            drafter=drafter.resolve() if drafter else None,
            broker_port=broker_port,
            registry_port=registry_port,
            serve_port=port,
            watch=watch,
            min_records=min_records,
            policy=RestartPolicy(max_restarts=max_restarts, window_s=restart_window),
        )  # fmt: skip
    )


def _supervision(r: dict) -> tuple[str, str, str]:
    """(restarts, last exit, next) of one status row, as `status` prints them."""
    if r["service"] == "supervisor":
        return "", "", ""
    nxt = "-"
    if r.get("state") == "gave up":
        nxt = f"[red]gave up[/]: {r.get('note')}"
    elif r.get("state") == "exited":
        nxt = "not restarted (clean exit)"
    elif r.get("next_restart_at"):
        nxt = f"restart in {max(0.0, r['next_restart_at'] - time.time()):.0f}s"
    elif r.get("state") in ("starting", "waiting") and not r["running"]:
        nxt = str(r["state"])
    return str(r.get("restarts") or 0), r.get("last_exit") or "-", nxt


def _print_stack(rows: list[dict]) -> None:
    t = Table(title=f"AdaFlash stack — {adaflash_home()}")
    for col in ("service", "running", "pid", "where", "restarts", "last exit", "next"):
        t.add_column(col)
    for r in rows:
        up_down = "[green]up[/]" if r["running"] else "[red]down[/]"
        t.add_row(r["service"], up_down, str(r["pid"] or "-"), r["where"], *_supervision(r))
    console.print(t)
    for r in rows:
        if c := r.get("suffix_cache"):
            offsets = ", ".join(f"{k}@{v}" for k, v in sorted(c["last_offsets"].items())) or "none yet"
            console.print(
                f"{r['service']} suffix cache: {c['responses']} responses, {c['tokens']} tokens "
                f"(~{c['bytes'] / 2**20:.1f} MiB), {c['tenants']} tenants; last clean offsets: {offsets}"
            )


@app.command()
def demo(
    target: TargetOpt = "smollm2",
    drafter: Annotated[
        Path | None,
        typer.Option(help="drafter dir (default: the shipped drafters/smollm2; tiny: a quick one)"),
    ] = None,
    requests: Annotated[int | None, typer.Option(help="chat requests of demo traffic (default 160)")] = None,
    focus_domain: Annotated[
        str | None, typer.Option(help="the domain traffic shifts to: math | code (default code)")
    ] = None,
    max_tokens: Annotated[int | None, typer.Option(help="tokens per answer (default 64)")] = None,
    epochs: Annotated[
        int | None, typer.Option(help="training epochs over the new records (2 records a step) (default 2)")
    ] = None,
    heldout_per_domain: Annotated[
        int | None, typer.Option(help="held-out records per domain for the gate (default 24)")
    ] = None,
    home: Annotated[Path, typer.Option(help="the demo's own stack state (wiped first)")] = Path(
        ".adaflash/demo"
    ),
) -> None:
    """The whole loop once: traffic → governance → pipeline → gate → reload → served v1 vs v2 →
    lineage → rollback. Writes HOME/scenario.json.

    Serves the drafter that ships in git; it never trains one on the fly (a loaded machine would
    only make that slower, never different). The gate decides on its evidence; the demo never
    overrides it (a rejected challenger stays unpromoted, and the demo says why)."""
    from adaflash.ops.demo import Scenario, ScenarioConfig

    setup_torch()
    if drafter is None:
        if target != "smollm2":
            raise InputError("--drafter DIR is required for targets other than smollm2")
        drafter = Path("drafters/smollm2")
    if not (drafter / "config.json").exists():
        raise InputError(
            f"no drafter at {drafter}: a checkout ships drafters/smollm2 (git status shows whether it "
            "was deleted); `make bootstrap` rebuilds it"
        )
    given = {"requests": requests, "focus_domain": focus_domain, "max_tokens": max_tokens, "epochs": epochs,
             "heldout_per_domain": heldout_per_domain}  # fmt: skip
    cfg = ScenarioConfig(
        target=target, drafter=drafter, home=home, **{k: v for k, v in given.items() if v is not None}
    )
    Scenario(cfg, console).run()


@app.command()
def up(
    target: TargetOpt = "smollm2",
    drafter: Annotated[
        Path | None, typer.Option(help="bootstrap drafter, served until a champion exists")
    ] = Path("drafters/smollm2"),
    broker_port: BrokerPortOpt = 9092,
    registry_port: RegistryPortOpt = 5000,
    port: ServePortOpt = 8000,
    watch: Annotated[bool, typer.Option(help="start the pipeline watcher")] = True,
    min_records: Annotated[int, typer.Option(help="new clean records that trigger a pipeline run")] = 128,
    max_restarts: Annotated[
        int, typer.Option(min=0, help="restarts of one service within --restart-window before giving up")
    ] = 5,
    restart_window: Annotated[float, typer.Option(min=1.0, help="seconds over which restarts count")] = 300.0,
) -> None:
    """Start the embedded stack: broker, MLflow, serving engine, governance, pipeline watcher, and
    the supervisor that restarts a service that dies (backoff 1 s doubling to 30 s).

    Run again on a running stack, it starts whatever is not running (a service the supervisor
    gave up on, or one that exited cleanly) and leaves the rest alone."""
    if drafter is not None and not (drafter / "config.json").exists():
        raise InputError(f"no drafter at {drafter}: run `make bootstrap` or pass --drafter DIR")
    stack = _stack(target, drafter, broker_port, registry_port, port, watch, min_records, max_restarts,
                   restart_window)  # fmt: skip
    with err_console.status("starting") as st:
        stack.up(progress=lambda name: st.update(f"starting {name}..."))
    _print_stack(stack.status())


def _ports(broker_port: int, registry_port: int, port: int):
    """The running stack, found by its ports (what `down` and `status` need of it)."""
    return _stack("smollm2", None, broker_port, registry_port, port, True, 128)


stack_ports = shared_options(
    _ports,
    [
        option("broker_port", BrokerPortOpt, 9092),
        option("registry_port", RegistryPortOpt, 5000),
        option("port", ServePortOpt, 8000),
    ],
)


@app.command()
@stack_ports
def down(stack) -> None:
    """Stop everything `adaflash up` started: the supervisor first, so nothing restarts."""
    stopped = stack.down()
    console.print("stopped: " + (", ".join(stopped) or "nothing was running"))


@app.command()
@stack_ports
def status(stack, as_json: JsonOpt = False) -> None:
    """One view of the embedded stack's services: up or down, restarts, last exit, next restart.
    Exits 1 unless every service (and the supervisor) runs."""
    rows = stack.status()
    if as_json:
        console.print_json(json.dumps(rows))
    else:
        _print_stack(rows)
    if not all(r["running"] for r in rows):
        raise typer.Exit(1)


@app.command(hidden=True)
def supervise() -> None:
    """The stack's supervisor, in the foreground: what `adaflash up` starts in the background
    (reads $ADAFLASH_HOME/stack-layout.json)."""
    import logging

    from adaflash.ops.stack import Stack, StackConfig

    layout = adaflash_home() / "stack-layout.json"
    try:
        cfg = StackConfig.from_json(json.loads(layout.read_text())["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"no stack layout at {layout} ({e}): start the stack with `adaflash up`") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # the broker's topic check, each restart
    Stack(cfg).supervise()
