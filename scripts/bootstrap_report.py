"""Render a bootstrap run's metrics as markdown (for BENCHMARKS.md) and copy its plot.

python scripts/bootstrap_report.py drafters/smollm2-bootstrap --out benchmarks
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def render(m: dict) -> str:
    lines = [
        f"Target `{m['target']}` (fingerprint {m['target_fingerprint']}); budget {m['budget_minutes']} min, "
        f"wall {m['wall_minutes']} min, of which training {m['train_minutes']} min "
        f"({m['steps']} steps, {m['seen_sequences']} sequences seen); data: {m['train_sequences']} greedy "
        f"responses, {m['train_tokens']} tokens.",
        "",
        "| domain | held-out seqs | τ dflash (k=16) | τ adaflash | mean k̂ adaflash | \\|â − a*\\| |",
        "|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for dom, r in m["heldout"].items():
        ada, khat, mae = (
            r.get(k, nan) for k in ("adaflash_tau", "adaflash_mean_verify_len", "length_head_mae")
        )
        lines.append(
            f"| {dom} | {r['n_sequences']} | {r['dflash_tau']:.3f} | {ada:.3f} | {khat:.2f} | {mae:.3f} |"
        )
    acc = m["heldout"]["all"]["accept_rate_by_position"]
    lines += [
        "",
        "Acceptance rate by draft position (all domains): " + ", ".join(f"{a:.2f}" for a in acc),
        "",
    ]
    lines += ["| training minutes | sequences seen | τ dflash | evaluated on |", "|---|---|---|---|"]
    for p in m["tau_vs_budget"]:
        lines.append(
            f"| {p['train_minutes']} | {p['seen_sequences']} | {p['dflash_tau']:.3f} | {p['subset']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks"))
    a = ap.parse_args()
    m = json.loads((a.drafter / "bootstrap_metrics.json").read_text())
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bootstrap_metrics.json").write_text(json.dumps(m, indent=2))
    (a.out / "bootstrap.md").write_text(render(m))
    if (a.drafter / "tau_vs_budget.png").exists():
        shutil.copy(a.drafter / "tau_vs_budget.png", a.out / "bootstrap_tau_vs_budget.png")
    print(render(m))


if __name__ == "__main__":
    main()
