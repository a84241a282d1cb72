"""Plots for metrics files (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_tau_vs_budget(metrics: dict, out: Path) -> Path:
    """τ (dflash, held-out) against training minutes, from `bootstrap_metrics.json`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = metrics["tau_vs_budget"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    sub = [p for p in curve if p.get("subset") != "full"]
    full = [p for p in curve if p.get("subset") == "full"]
    if sub:
        ax.plot(
            [p.get("step", p["train_minutes"]) for p in sub],
            [p["dflash_tau"] for p in sub],
            "o-",
            label=f"held-out subset ({sub[0]['subset']})",
        )
    if full:
        ax.plot(
            [p.get("step", p["train_minutes"]) for p in full],
            [p["dflash_tau"] for p in full],
            "s",
            color="C3",
            label="full held-out evaluation",
        )
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    by_step = all("step" in p for p in curve)
    ax.set_xlabel("optimiser steps" if by_step else "training minutes (2 CPU cores)")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title(f"Bootstrap on {metrics['target']}: τ vs training")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
