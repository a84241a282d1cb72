"""The online adaptation experiment's loop on the tiny target: serve → govern → train → serve."""

from __future__ import annotations

import json

import pytest

from adaflash.bench.adaptation import AdaptationSpec, run_adaptation
from adaflash.bench.adaptation_report import write_outputs
from adaflash.models.checkpoint import save_drafter
from tests.conftest import make_bundle


def test_adaptation_rounds_are_lossless_governed_and_retrain_the_learners(tmp_path, tiny32):
    b = make_bundle(tiny32, block_size=8)
    save_drafter(tmp_path / "boot", b.drafter, b.length_head, b.meta)
    spec = AdaptationSpec(rounds=2, per_round=4, concurrency=4, max_new_tokens=12, epochs=1, c1_prompts=2)
    result = run_adaptation(tiny32, tmp_path / "boot", spec, tmp_path / "work", log=lambda s: None)

    r0, r1 = result["rounds"]
    assert r0["prompts"] != r1["prompts"]  # every round serves new traffic
    for row in result["rounds"]:
        assert set(row["methods"]) == {"ar", "dflash", "frozen-cost", "suffix", "osd", "fkl", "adaflash"}
        for name, cell in row["methods"].items():
            assert cell["output_tokens"] > 0 and cell["c1"]["tps"] > 0
            if name != "ar":
                assert cell["lossless"] == 1.0 and cell["c1"]["lossless"] == 1.0, (name, row["round"])
                assert cell["tps_vs_ar"] > 0 and sum(p["rounds"] for p in cell["proposers"].values()) > 0
            if name not in ("ar", "frozen-cost", "suffix"):  # frozen-cost's drafter is dflash's
                assert 1.0 <= cell["tau_full"]
        # The length head's reliability bins hold every replayed round of its k̂ walk.
        for name in ("dflash", "adaflash"):
            bins = row["methods"][name]["reliability"]
            assert bins and all(0 <= b["a_hat"] <= 1 and 0 < b["a_star"] <= 1 for b in bins)
    # Round 0's traffic went through governance and trained each learner; round 1 served that drafter.
    for name, loss in (("osd", "osd"), ("fkl", "fkl"), ("adaflash", "opd")):
        gov = r0["methods"][name]["governance"]
        assert gov["in"] == 4 and gov["clean"] + gov["quarantined"] == 4 and gov["clean"] >= 1
        # The round's last clean records are held out of its training: the retrained drafter's
        # release evidence, measured on them and stamped into its checkpoint for the next round.
        held = min(spec.holdout, gov["clean"] - 1)
        assert r0["methods"][name]["training"]["records"] == gov["clean"] - held
        trained = tmp_path / "work" / name / "drafter-r1"
        assert r1["methods"][name]["drafter"] == str(trained)
        meta = json.loads((trained / "adaflash.json").read_text())
        assert meta["lineage"]["loss"] == loss
        evidence = r0["methods"][name]["evidence"]
        if held:
            assert evidence["records"] == held and evidence["rounds"] == meta["acceptance"]["rounds"] > 0
            assert 1.0 + sum(meta["acceptance"]["survival"]) == pytest.approx(evidence["tau_full"], abs=1e-3)
        else:
            assert evidence is None and meta.get("acceptance") is None
        assert "training" not in r1["methods"][name]  # nothing trains on the last round
    assert r1["methods"]["dflash"]["drafter"] == str(tmp_path / "boot")  # the fixed line stays fixed
    # The fast learner: adaflash's clean records of round 0 are in its suffix cache for round 1
    # (each request drafting from its own tenant's responses); no other learner keeps one.
    assert r0["methods"]["adaflash"]["governance"]["suffix_cache_tokens"] > 0
    assert "suffix_cache_tokens" not in r0["methods"]["osd"]["governance"]
    assert "suffix" in r1["methods"]["suffix"]["proposers"]

    files = write_outputs(result, tmp_path / "out")
    names = ["results.json", "results.md", "online_adaptation.png", "length_head_reliability.png"]
    assert [f.name for f in files] == names
    md = (tmp_path / "out" / "results.md").read_text()
    # four tables (C = 8, acceptance, C = 1, learning at C = 1): header + one row per round
    assert md.count("\n| ") == 12 and "adaflash × frozen-cost" in md
    c1_table = md.split("**At C = 1**")[1].split("**Learning")[0]
    c1_rows = [ln for ln in c1_table.splitlines() if ln[:3] in ("| 0", "| 1")]
    for row, line in zip(result["rounds"], c1_rows, strict=True):
        c1 = {m: row["methods"][m]["c1"] for m in ("adaflash", "osd")}
        assert line.endswith(f"| {c1['adaflash']['tps'] / c1['osd']['tps']:.2f}× |")

    # Interrupted after round 0: a rerun continues from the saved state, with round 0's drafters.
    state_path = tmp_path / "work" / "state.json"
    state = json.loads(state_path.read_text())
    state["rows"] = state["rows"][:1]
    state_path.write_text(json.dumps(state))
    lines: list[str] = []
    again = run_adaptation(tiny32, tmp_path / "boot", spec, tmp_path / "work", log=lines.append)
    assert lines[0].startswith("resuming after round 0")
    assert again["rounds"][0] == json.loads(json.dumps(r0))
    assert again["rounds"][1]["methods"]["adaflash"]["drafter"] == str(
        tmp_path / "work" / "adaflash" / "drafter-r1"
    )
    assert again["rounds"][1]["methods"]["adaflash"]["lossless"] == 1.0
    # The resumed learner rebuilt its suffix cache from the same clean records: the suffix cell,
    # deterministic, drafts exactly as before.
    assert again["rounds"][1]["methods"]["suffix"]["proposers"] == r1["methods"]["suffix"]["proposers"]
