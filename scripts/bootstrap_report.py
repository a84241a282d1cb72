"""Render a bootstrap run's metrics as markdown (for BENCHMARKS.md) and copy its plot.

python scripts/bootstrap_report.py drafters/smollm2 --out benchmarks
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from adaflash.training.model_card import acceptance_table, curve_table


def render(m: dict) -> str:
    return "\n".join([*acceptance_table(m), "", *curve_table(m)]) + "\n"


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
