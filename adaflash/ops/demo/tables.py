"""The demo's tables: the gate's evidence, a rejection in plain words, and before vs after."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _verdict(iv: dict, policy: dict, overall: bool) -> str:
    if overall:
        if iv["low"] > policy["min_gain"]:
            return "[green]win[/]"
        return "[red]worse[/]" if iv["high"] < 0 else "[yellow]not enough evidence[/]"
    if iv["domain"] != "all" and iv["n"] < policy["min_domain_records"]:
        return "too few to veto"
    return "[red]regresses[/]" if iv["high"] < -policy["max_domain_regression"] else "no regression"


def gate_table(decision: dict, version: str, champion: str) -> Table:
    """The gate's evidence (a GateDecision's dict): one row per metric and domain."""
    p = decision["policy"]
    t = Table(
        title=f"shadow gate: v{version} vs v{champion} on the same held-out records "
        f"({p['confidence']:.0%} paired bootstrap, {p['resamples']} resamples, seed {p['seed']})"
    )
    cols = (
        "metric",
        "domain",
        "records",
        f"v{champion}",
        f"v{version}",
        "Δ per record",
        "interval",
        "verdict",
    )
    for col in cols:
        t.add_column(col, justify="right")
    for iv in decision["intervals"]:
        overall = iv["metric"] == p["metric"] and iv["domain"] == "all"
        label = iv["metric"] + ("" if iv["metric"] == p["metric"] else " (guard)")
        t.add_row(label, iv["domain"], str(iv["n"]), f"{iv['champion']:.3f}", f"{iv['challenger']:.3f}",
                  f"{iv['gain']:+.3f}", f"\\[{iv['low']:+.3f}, {iv['high']:+.3f}]",
                  _verdict(iv, p, overall))  # fmt: skip
    return t


def rejection_text(decision: dict, version: str, champion: str) -> str:
    """What the demo says when the gate rejects: the reasons, and that nothing overrides them."""
    reasons = "\n".join(f"    - {r}" for r in decision["reasons"])
    return (
        f"  [bold red]the gate rejected v{version}[/]; v{champion} stays champion and the fleet keeps "
        f"serving it. The reasons:\n{reasons}\n"
        f"  The demo does not override the gate. A person who decides otherwise runs "
        f'`adaflash registry promote {version} --override-gate --reason "..."`, recorded as a manual '
        "override."
    )


def before_after(console: Console, before: str, after: str, metrics: dict, fleet: dict, served: dict,
                 fresh: int) -> None:  # fmt: skip
    """The shadow eval's numbers of both versions, what `fresh` prompts served by each measured,
    and the fleet's reload and rollback."""

    def m(prefix: str, dom: str, key: str) -> float | None:
        v = metrics.get(f"{prefix}.{dom}.{key}")
        return float(v) if v not in (None, "None") else None

    t = Table(title=f"before (v{before}, bootstrap) vs after (v{after}, retrained on governed traffic)")
    for col in ("", "before", "after", "change"):
        t.add_column(col, justify="right")
    doms = sorted(
        {k.split(".")[1] for k in metrics if k.startswith("shadow.")}, key=lambda d: (d != "all", d)
    )
    rows = [
        ("τ over the full block", "tau_full"),
        ("τ served (k̂-censored)", "tau"),
        ("mean k̂", "mean_verify_len"),
        ("verified / output token", "verified_per_output_token"),
        ("tok/s", "tps"),
        ("tok / CPU-second", "tokens_per_cpu_s"),
        ("|â − a*|", "calibration_error"),
    ]
    for dom in doms:
        for label, key in rows if dom == "all" else rows[:1]:
            a, b = m("champion", dom, key), m("shadow", dom, key)
            if a is None or b is None:
                continue
            change = f"{(b / a - 1):+.1%}" if a else "–"
            t.add_row(f"shadow eval, {dom}: {label}", f"{a:.3f}", f"{b:.3f}", change)
    old, new = served[before], served[after]
    for label, key in (("tok/s", "tps"), ("tok / server CPU-second", "tokens_per_server_cpu_s"),
                       ("τ served", "tau"), ("mean k̂", "mean_verify_len")):  # fmt: skip
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            continue
        t.add_row(f"served, {fresh} fresh prompts: {label}", f"{a:.3f}", f"{b:.3f}",
                  f"{(b / a - 1):+.1%}" if a else "–")  # fmt: skip
    t.add_row("served by the fleet", f"v{before}", f"v{after} (reload {fleet['promote_s']:.1f}s)",
              f"rollback → v{fleet['rollback_version']} ({fleet['rollback_s']:.1f}s)")  # fmt: skip
    console.print(t)
