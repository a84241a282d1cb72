"""`scripts/gpu_check.sh`'s CPU dry run: the same script a GPU lease runs (issue 34), on the tiny
target with the Triton interpreter, so a broken stage is found here and not on a short lease."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    out = tmp_path / "check"
    cmd = [
        str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--target", "tiny",
        "--steps", "4", "--seqs-per-step", "2", "--eval-per-domain", "2",
        "--max-train-prompts", "12", "--max-new-tokens", "16", "--out", str(out),
    ]  # fmt: skip
    env = {"ADAFLASH_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    # Every kernel agreed with its reference: greedy and sampling verify, and three loss kinds.
    ops = {r["op"].split("[")[0] for r in res["kernels"]["rows"]}
    assert ops == {"greedy_verify", "sampling_verify", "drafter_loss_rows"}
    assert all(r["equal"] for r in res["kernels"]["rows"]) and len(res["kernels"]["rows"]) == 5
    boot = res["bootstrap"]
    assert boot["ok"] and boot["steps"] == 4 and boot["steps_per_second"] > 0
    assert set(boot["heldout_tau"]) == {"math", "code", "chat", "all"}
    assert all(tau >= 1.0 for tau in boot["heldout_tau"].values())
    assert (out / "drafter" / "config.json").exists()
    assert "Triton vs the torch reference" in (out / "results.md").read_text()
