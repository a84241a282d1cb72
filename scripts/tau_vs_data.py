"""τ against training-data size: bootstrap runs that differ only in how many responses they train on.

Usage (each run made with the same recipe and --steps, differing in --max-train-prompts):
    python scripts/tau_vs_data.py RUN_DIR [RUN_DIR ...] --out benchmarks/drafter-data
Writes tau_vs_data.json, tau_vs_data.md and tau_vs_data.png: held-out τ (dflash, full block,
greedy) and position-1 acceptance per domain against response tokens, with the n-gram baseline on
the same held-out sequences, and a log-linear fit of τ against tokens (what more data would buy).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

DOMAINS = ("math", "code", "chat", "all")


def load(run: Path) -> dict:
    m = json.loads((run / "bootstrap_metrics.json").read_text())
    return {
        "run": str(run),
        "train_sequences": m["train_sequences"],
        "train_tokens": m["train_tokens"],
        "steps": m["steps"],
        "epochs": m["epochs"],
        "train_minutes": m["train_minutes"],
        "tau": {d: m["heldout"][d]["dflash_tau"] for d in DOMAINS},
        "acc1": {d: m["heldout"][d]["accept_rate_by_position"][0] for d in DOMAINS},
        "ngram_tau": {d: m["heldout"][d]["ngram_tau"] for d in DOMAINS},
    }


def loglinear(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares τ = a + b·log2(tokens): b is the gain per doubling of the data."""
    xs = [math.log2(t) for t, _ in points]
    ys = [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/drafter-data"))
    args = ap.parse_args()
    rows = sorted((load(r) for r in args.runs), key=lambda r: r["train_tokens"])
    fits = {}
    for d in DOMAINS:
        a, b = loglinear([(r["train_tokens"], r["tau"][d]) for r in rows])
        bar = 2.0 if d == "chat" else 2.5
        need = 2 ** ((bar - a) / b) if b > 0 else None
        fits[d] = {"a": round(a, 4), "per_doubling": round(b, 4), "bar": bar,
                   "tokens_for_bar": round(need) if need else None}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tau_vs_data.json").write_text(json.dumps({"runs": rows, "fits": fits}, indent=2))
    head = "| response tokens | sequences | steps | epochs | τ math | τ code | τ chat | τ all | acc@1 all |"
    lines = [head + " n-gram τ all |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tau"]
        cells = [f"{r['train_tokens']:,}", r["train_sequences"], r["steps"], r["epochs"]]
        cells += [f"{t[d]:.3f}" for d in DOMAINS]
        cells += [f"{r['acc1']['all']:.3f}", f"{r['ngram_tau']['all']:.3f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "| domain | τ gain per doubling of data | bar | response tokens the fit needs |"]
    lines.append("|---|---|---|---|")
    for d, f in fits.items():
        t = f["tokens_for_bar"]
        need = "never (no gain)" if not t else f"{t:,}"
        if t and t >= 1e9:
            need = f"> 10^{int(math.log10(t))} (out of reach)"
        lines.append(f"| {d} | {f['per_doubling']:+.3f} | {f['bar']} | {need} |")
    (args.out / "tau_vs_data.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for d in DOMAINS:
        xs = [r["train_tokens"] for r in rows]
        line = ax.plot(xs, [r["tau"][d] for r in rows], marker="o", label=f"drafter {d}")[0]
        ax.axhline(rows[-1]["ngram_tau"][d], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training response tokens (log scale)")
    ax.set_ylabel("held-out τ (full block, greedy)")
    ax.set_title("τ against data (dotted: n-gram lookup on the same sequences)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "tau_vs_data.png", dpi=120)
    print((args.out / "tau_vs_data.md").read_text())


if __name__ == "__main__":
    main()
