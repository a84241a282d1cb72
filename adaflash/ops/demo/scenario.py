"""The demo's run, top to bottom: each line one step (or group) of the loop."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console

from adaflash.ops.demo.config import ScenarioConfig
from adaflash.ops.demo.loop import (
    lineage,
    privacy,
    promotion,
    register_bootstrap,
    rollback,
    run_pipeline,
    start,
)
from adaflash.ops.demo.served import compare_served, fast_learner, serve_fresh, still_served
from adaflash.ops.demo.session import Session
from adaflash.ops.demo.tables import before_after
from adaflash.ops.demo.traffic import governance, plant_anomalies, send_traffic


class Scenario:
    def __init__(self, cfg: ScenarioConfig, console: Console) -> None:
        self.cfg, self.console = cfg, console
        self.session = Session(cfg, console)
        self.report: dict = {"config": {**asdict(cfg), "drafter": str(cfg.drafter), "home": str(cfg.home)}}

    def run(self) -> dict:
        s, r = self.session, self.report
        start(s)
        try:
            before = register_bootstrap(s)
            r["traffic"] = send_traffic(s)
            planted = plant_anomalies(s)
            r["governance"] = governance(s, r["traffic"]["requests"] + planted)
            r["fast_learner"] = fast_learner(s, r["governance"]["clean"])
            first = serve_fresh(s, before, f"5b. served by v{before}: fresh prompts, before any training")
            r["pipeline"] = run_pipeline(s, r["governance"]["clean"])
            after = r["pipeline"]["version"]
            r["promotion"] = promotion(s, after, before)
            promoted = r["promotion"]["gate_promoted"]
            if promoted:
                latest = serve_fresh(s, after, f"8. served by v{after}: the same prompts after the reload")
            r["lineage"] = lineage(s, after)
            if promoted:
                r["rollback"] = rollback(s, before)
                again = serve_fresh(s, before, f"11. served by v{before} again: the same prompts")
                served, r["served"] = compare_served(s, before, after, first, again, latest)
            else:
                r["served"] = still_served(s, before, first)  # what the fleet keeps serving
            r["privacy"] = privacy(s)
            if promoted:
                fleet = {
                    "promote_s": r["promotion"]["reload_seconds"],
                    "rollback_version": r["rollback"]["version"],
                    "rollback_s": r["rollback"]["reload_seconds"],
                }
                before_after(s.console, before, after, r["promotion"]["metrics"], fleet, served, len(s.fresh))
        finally:
            with self.console.status("adaflash down..."):
                s.stack.down()
        out = self.cfg.home / "scenario.json"
        out.write_text(json.dumps(r, indent=2, default=str))
        self.console.print(f"report: {out}")
        return r
