"""`make demo`'s scenario end to end on the tiny target: every service really started and stopped."""

from __future__ import annotations

import json

from rich.console import Console

from adaflash.models.checkpoint import save_drafter
from adaflash.ops.demo import PLANTED, Scenario, ScenarioConfig
from tests.conftest import make_bundle


def test_demo_scenario_runs_the_whole_loop_on_tiny(tmp_path, tiny32, monkeypatch):
    monkeypatch.setenv("ADAFLASH_THREADS", "1")
    b = make_bundle(tiny32, block_size=8)
    save_drafter(tmp_path / "drafter", b.drafter, b.length_head, b.meta)
    cfg = ScenarioConfig(
        target="tiny",
        drafter=tmp_path / "drafter",
        home=tmp_path / "demo",
        requests=16,
        max_tokens=16,
        epochs=1,
        shadow_max_new_tokens=16,
        anomalies_per_kind=2,  # identical garbage twice: each copy is quarantined
        pii_fraction=0.5,
    )
    console = Console(record=True, width=160)
    report = Scenario(cfg, console).run()
    text = console.export_text()

    gov = report["governance"]
    assert gov["in"] == 16 + 2 * len(PLANTED)
    assert gov["in"] == gov["clean"] + gov["quarantined"] + gov["duplicate"]
    # Served chat traffic is clean (its prompt text is the templated conversation the target saw).
    assert gov["clean"] == 16, gov
    # Every planted per-record anomaly is quarantined, with its own reason.
    for kind in ("vocab", "rounds", "length", "inconsistent", "repetition", "consent", "target"):
        assert gov["reasons"].get(kind, 0) >= 1, (kind, gov["reasons"])
    assert report["traffic"]["pii_prompts"] >= 1 and gov["pii_entities"]

    new = report["pipeline"]["version"]
    assert new == "2"  # v1 is the bootstrap champion
    assert report["lineage"]["trained_into"] == [new] and report["lineage"]["records"] >= 8
    assert report["rollback"]["version"] == "1"
    assert report["rollback"]["reload_seconds"] < 60 and report["promotion"]["reload_seconds"] < 60
    assert report["privacy"]["found"] == 0 and report["privacy"]["values"] >= 1
    assert "before (v1, bootstrap) vs after (v2" in text
    assert json.loads((tmp_path / "demo" / "scenario.json").read_text())["pipeline"]["version"] == "2"
    # `adaflash down` ran: no service of the demo is left behind.
    assert not list((tmp_path / "demo" / "stack").glob("*.json"))
