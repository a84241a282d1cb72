"""The loop's steps on the stack: start it (1), register the bootstrap champion (2), the
continual-training pipeline (6), the gate's decision and the reload (7), lineage (9), rollback
(10) and the search for PII at rest (12)."""

from __future__ import annotations

import os
import shutil
import time

from adaflash.ops.demo.config import ScenarioError
from adaflash.ops.demo.session import Session, output_to
from adaflash.ops.demo.tables import gate_table, rejection_text


def start(s: Session) -> None:
    s.step("1. adaflash up: broker, MLflow, serving engine, governance")
    shutil.rmtree(s.cfg.home, ignore_errors=True)
    # Children (serve's registry downloads, the pipeline) keep their state under the demo home.
    os.environ["ADAFLASH_HOME"] = str(s.cfg.home.resolve())
    with s.console.status("starting services...") as st:
        s.stack.up(timeout=300, progress=lambda name: st.update(f"starting {name}..."))
    for row in s.stack.status():
        s.console.print(f"  {row['service']:<11} pid {row['pid']}  {row.get('where') or ''}")


def register_bootstrap(s: Session) -> str:
    s.step("2. register the bootstrap drafter as the first champion")
    with s.registry() as reg:
        v = reg.register(s.cfg.drafter, lineage={"source": str(s.cfg.drafter)}, reason="demo bootstrap")
        reg.promote(v, who="demo", reason="first champion")
    took = s.wait_version(v)
    s.console.print(f"  v{v} is champion; the server follows the registry and serves v{v} ({took:.1f}s)")
    return v


def run_pipeline(s: Session, clean: int) -> dict:
    from adaflash.pipelines.continual import PipelineParams, run_local

    cfg = s.cfg
    s.step("6. continual-training pipeline (kfp.local): ingest → train → shadow eval → register → gate")
    c = s.stack.cfg
    params = PipelineParams(
        target=cfg.target,
        governance_dir=str(s.gov_dir),
        tracking_uri=c.tracking_uri,
        fallback_drafter=str(cfg.drafter.resolve()),
        bootstrap_servers=c.bootstrap_servers,
        min_records=min(clean, PipelineParams.min_records),
        heldout_per_domain=cfg.heldout_per_domain,
        epochs=cfg.epochs,
        lr=cfg.lr,
        random_anchors=cfg.random_anchors,
        min_gain=cfg.min_gain,
        gate_min_records=cfg.gate_min_records,
        concurrency=cfg.concurrency,
        max_new_tokens=cfg.shadow_max_new_tokens,
        gamma=cfg.gamma,
        gate_mode="auto",
    )
    t = time.monotonic()
    log = cfg.home.resolve() / "pipeline.log"
    s.console.print(f"  running; each step is a kfp.local subprocess (log: {log})")
    with output_to(log):
        run_local(cfg.home.resolve() / "kfp", params)
    with s.registry() as reg:
        latest = max(reg.versions(), key=lambda v: int(v.version))
    records, steps = (int(float(latest.metrics.get(f"train.{k}", 0))) for k in ("records", "steps"))
    s.console.print(
        f"  pipeline finished in {time.monotonic() - t:.0f}s; v{latest.version} trained on {records} "
        f"records × {cfg.epochs} epoch(s) = {steps} optimiser steps (lr {cfg.lr:g}); registered"
    )
    return {"seconds": time.monotonic() - t, "version": latest.version, "description": latest.description,
            "train_records": records, "train_steps": steps}  # fmt: skip


def promotion(s: Session, version: str, champion_before: str) -> dict:
    s.step("7. the gate's decision, on evidence, and the fleet's reload")
    with s.registry() as reg:
        champion = reg.champion()
        info = reg.show(version)
        shadow = reg.report(version, "shadow_report")
    if shadow is None:
        raise ScenarioError(f"v{version} was registered without its shadow report")
    decision = shadow["gate"]
    s.console.print(gate_table(decision, version, champion_before))
    promoted = champion == version
    if promoted != decision["promote"]:
        raise ScenarioError(f"the gate said {decision['promote']} but the champion is v{champion}")
    held = {d: r["n"] for d, r in shadow["challenger"]["domains"].items()}
    out = {"gate_promoted": promoted, "gate": decision, "metrics": info.metrics, "heldout_by_domain": held}
    if not promoted:
        s.console.print(rejection_text(decision, version, champion_before))
        return out
    s.console.print(f"  [green]promoted[/]: {decision['reasons'][0]}")
    out["reload_seconds"] = took = s.wait_version(version)
    s.console.print(f"  the server hot-reloaded v{version} {took:.1f}s after the promotion was visible")
    return out


def lineage(s: Session, version: str) -> dict:
    from adaflash.governance.config import GovernanceConfig
    from adaflash.governance.lineage import LineageStore

    s.step("9. lineage, both ways")
    store = LineageStore(GovernanceConfig(s.gov_dir).lineage_path)
    try:
        ids = store.records_for_version(version)
        rec = store.record(ids[0]) if ids else None
    finally:
        store.close()
    if rec is None:
        raise ScenarioError(f"v{version} names no training records in the lineage store")
    s.console.print(f"  adaflash lineage version {version}: {len(ids)} records")
    s.console.print(
        f"  adaflash lineage record {ids[0]}: tenant {rec['tenant_id']}, shard {rec['shard_id']}, "
        f"trained into {rec['trained_into']}"
    )
    return {"records": len(ids), "example": ids[0], "trained_into": rec["trained_into"]}


def rollback(s: Session, expected: str) -> dict:
    s.step("10. rollback")
    with s.registry() as reg:
        ev = reg.rollback(who="demo", reason="demo: exercising the one-command rollback")
    took = s.wait_version(expected)
    s.console.print(
        f"  adaflash registry rollback → v{ev.version} champion; the server serves it after {took:.1f}s"
    )
    return {"version": ev.version, "reload_seconds": took}


def privacy(s: Session) -> dict:
    """Grep everything the demo left at rest for the planted PII values."""
    s.step("12. no PII at rest")
    found, files = [], 0
    for p in s.cfg.home.rglob("*"):
        if not p.is_file():
            continue
        files += 1
        data = p.read_bytes()
        found += [(str(p), v) for v in s.canaries if v.encode() in data]
    s.console.print(
        f"  {len(set(s.canaries))} planted values searched in {files} files under {s.cfg.home}: "
        f"{'none found' if not found else f'[red]{len(found)} found[/]'}"
    )
    if found:
        raise ScenarioError(f"PII at rest: {found[:3]}")
    return {"values": len(set(s.canaries)), "files": files, "found": 0}
