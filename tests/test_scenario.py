"""`make demo`'s scenario end to end on the tiny target: every service really started and stopped."""

from __future__ import annotations

import json

import pytest
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
        requests=48,  # 36 code (the shift), 6 math, 6 chat
        max_tokens=24,
        heldout_per_domain=12,  # 12 code + 3 math + 3 chat held out: the gate's 18 paired records
        # The tiny drafter starts from random weights: a short, fast budget teaches it a lot.
        epochs=6,
        lr=2e-3,
        random_anchors=16,
        shadow_max_new_tokens=24,
        fresh_prompts=4,
        anomalies_per_kind=2,  # identical garbage twice: each copy is quarantined
        pii_fraction=0.5,
    )
    console = Console(record=True, width=160)
    report = Scenario(cfg, console).run()
    text = console.export_text()

    gov = report["governance"]
    assert report["traffic"]["by_domain"] == {"math": 6, "code": 36, "chat": 6}
    assert gov["in"] == 48 + 2 * len(PLANTED)
    assert gov["in"] == gov["clean"] + gov["quarantined"] + gov["duplicate"]
    # Served chat traffic is clean (its prompt text is the templated conversation the target saw).
    assert gov["clean"] == 48, gov
    # Every planted per-record anomaly is quarantined, with its own reason.
    for kind in ("vocab", "rounds", "length", "inconsistent", "repetition", "consent", "target"):
        assert gov["reasons"].get(kind, 0) >= 1, (kind, gov["reasons"])
    assert report["traffic"]["pii_prompts"] >= 1 and gov["pii_entities"]

    # The fast learner learned every clean record through the governed stream, and its A/B (plain
    # AR, cache off, cache on) served the same tokens.
    fast = report["fast_learner"]
    assert fast["cache"]["responses"] == gov["clean"] and fast["cache"]["tenants"] == cfg.tenants
    assert fast["cache"]["last_offsets"] and fast["identical"] == cfg.fresh_prompts
    assert "5a. the fast learner" in text

    new = report["pipeline"]["version"]
    assert new == "2"  # v1 is the bootstrap champion
    # The budget in steps, as the registry recorded it: 30 training records, 2 a step, 6 epochs.
    assert (report["pipeline"]["train_records"], report["pipeline"]["train_steps"]) == (30, 90)
    # The gate promoted v2 on its evidence (the demo has no override path), and says how much.
    promo = report["promotion"]
    assert promo["gate_promoted"] and promo["gate"]["promote"], promo["gate"]["reasons"]
    assert promo["heldout_by_domain"] == {"all": 18, "code": 12, "math": 3, "chat": 3}
    ivs = promo["gate"]["intervals"]
    overall = next(i for i in ivs if i["metric"] == "tau_full" and i["domain"] == "all")
    assert overall["n"] == 18 and overall["low"] > 0
    assert "shadow gate: v2 vs v1" in text and "override" not in report["pipeline"]["description"]
    # Served after the reload and after the rollback: the same fresh prompts on both versions.
    served = report["served"]
    assert served["v2"]["requests"] == served["v1"]["requests"] == 4
    assert served["v1"]["version"] == "1" and served["v2"]["version"] == "2"
    assert served["v2"]["tps"] > 0 and served["v1"]["tau"] >= 1 and served["identical_outputs"] == 4
    # v1 brackets v2: served before training and after the rollback; its rate is their mean.
    runs = served["v1_runs"]
    assert not any("outputs" in row for row in (served["v1"], served["v2"], *runs))
    assert [r["version"] for r in runs] == ["1", "1"] and served["v1"]["runs"] == 2
    assert served["v1"]["tps"] == pytest.approx((runs[0]["tps"] + runs[1]["tps"]) / 2)
    assert served["v1"]["completion_tokens"] == runs[0]["completion_tokens"] + runs[1]["completion_tokens"]
    assert served["tps_gain"] == pytest.approx(served["v2"]["tps"] / served["v1"]["tps"] - 1)
    assert "v1 brackets v2" in text
    assert report["lineage"]["trained_into"] == [new] and report["lineage"]["records"] >= 8
    assert report["rollback"]["version"] == "1"
    assert report["rollback"]["reload_seconds"] < 60 and report["promotion"]["reload_seconds"] < 60
    assert report["privacy"]["found"] == 0 and report["privacy"]["values"] >= 1
    assert "before (v1, bootstrap) vs after (v2" in text
    assert json.loads((tmp_path / "demo" / "scenario.json").read_text())["pipeline"]["version"] == "2"
    # `adaflash down` ran: no service of the demo is left behind.
    assert not list((tmp_path / "demo" / "stack").glob("*.json"))
