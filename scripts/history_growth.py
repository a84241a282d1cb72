"""Does served speed grow with the governed history? The fast learner's claim, measured.

Per domain, one engine and one set of timed prompts (the set's prompts after every warm-up
prompt, so none is ever in the history). The tenant's history grows in stages: before each
stage's timed runs, the next warm-up prompts are served, governed (Presidio + the anomaly
filters, `bench.warmup`) and learned by the suffix cache, exactly as `adaflash bench --warm N`
does in one go. At each stage, `--repeats` runs per method at C = 1, alternating the order.

    python scripts/history_growth.py --domains sql,edit,tools --stages 0,32,128,256 \\
        --methods ar,suffix,adaflash-cost --repeats 3 --out benchmarks/history-growth

Writes results.json, results.md (mean of runs beside the best) and history_growth.png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from adaflash.bench.serving import BenchSpec, bench_engine, run_cell, warm_domain, workload
from adaflash.models.checkpoint import load_drafter_for
from adaflash.models.targets import load_target


def stage_cells(engine, spec: BenchSpec, domain: str, rows: list[list[int]], prefix: dict) -> list[dict]:
    """`spec.repeats` runs per method of the timed prompts at C = 1, with the history as it is."""
    runs: dict[str, list[dict]] = {m: [] for m in spec.methods}
    outs: dict[str, list] = {m: [] for m in spec.methods}
    for rep in range(spec.repeats):
        for m in spec.methods if rep % 2 == 0 else spec.methods[::-1]:
            cell, out = run_cell(engine, rows, m, 1, spec.max_new_tokens, f"bench-{domain}", prefix)
            runs[m].append(cell)
            outs[m].append(out)
    ar = runs.get("ar")
    ref = outs["ar"][0] if ar else None
    cells = []
    for m, cs in runs.items():
        tps = [c["tps"] for c in cs]
        cell = {
            "method": m,
            "tps_runs": tps,
            "tps_mean": sum(tps) / len(tps),
            "tps_best": max(tps),
            "tau": sum(c["tau"] for c in cs) / len(cs),
            "mean_verify_len": sum(c["mean_verify_len"] for c in cs) / len(cs),
            "proposers": cs[-1]["proposers"],
            "identical_to_ar": min(sum(a == b for a, b in zip(o, ref, strict=True)) for o in outs[m])
            if ref
            else None,
        }
        if ar:
            ar_mean = sum(c["tps"] for c in ar) / len(ar)
            cell["speedup_mean"] = cell["tps_mean"] / ar_mean
            cell["speedup_best"] = cell["tps_best"] / max(c["tps"] for c in ar)
        cells.append(cell)
    return cells


def run(args) -> dict:
    target = load_target(args.target)
    bundle = load_drafter_for(args.drafter, target)
    stages = sorted(int(s) for s in args.stages.split(","))
    spec = BenchSpec(
        methods=args.methods.split(","),
        concurrency=[1],
        domains=args.domains.split(","),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warm=stages[-1],
        hf_baseline=False,
        llamacpp=False,
        bounds=False,
    )
    every = workload(target, spec, args.prompts)
    longest = max(len(ids) for rows in every.values() for _, ids in rows)
    result: dict = {"domains": {}}
    for domain in spec.domains:
        rows = [ids for _, ids in every[domain]]
        warm, timed = rows[: stages[-1]], rows[stages[-1] :]
        if len(timed) < args.prompts:
            raise SystemExit(f"{domain}: {len(rows)} prompts, fewer than {stages[-1]} + {args.prompts}")
        engine = bench_engine(target, bundle, spec, longest)  # a fresh history per domain
        out, learned = [], 0
        for stage in stages:
            if stage > learned:
                warm_domain(engine, spec, domain, warm[learned:stage], print)
                learned = stage
            # Every run starts from the prompt heads the warm-up left, as in `adaflash bench`.
            prefix = engine.prefix_cache.snapshot()
            t0 = time.perf_counter()
            cells = stage_cells(engine, spec, domain, timed[: args.prompts], prefix)
            cache = asdict(engine.suffix_cache.stats())
            seconds = time.perf_counter() - t0
            out.append({"history": stage, "cells": cells, "cache": cache, "seconds": seconds})
            for c in cells:
                x = f"x AR mean {c.get('speedup_mean', 0):.3f} best {c.get('speedup_best', 0):.3f}"
                print(f"{domain} history {stage:4d} {c['method']:14s} tau {c['tau']:.3f} {x}")
        result["domains"][domain] = out
    return result


def markdown(result: dict) -> str:
    s = result["spec"]
    lines = [
        "# Served speed against the governed history (C = 1)",
        "",
        f"{s['prompts']} timed prompts per domain (after every warm-up prompt), {s['repeats']} runs per "
        f"method and stage, {s['max_new_tokens']} new tokens, greedy. × AR: mean of runs (best run).",
        "",
        "| domain | history | method | τ | × AR mean (best) | identical to AR |",
        "|---|---|---|---|---|---|",
    ]
    for domain, stages in result["domains"].items():
        for st in stages:
            for c in st["cells"]:
                if c["method"] == "ar":
                    continue
                lines.append(
                    f"| {domain} | {st['history']} | {c['method']} | {c['tau']:.3f} "
                    f"| {c['speedup_mean']:.3f} ({c['speedup_best']:.3f}) | {c['identical_to_ar']} |"
                )
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(result["domains"])
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.4), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], domains, strict=True):
        stages = result["domains"][d]
        methods = [c["method"] for c in stages[0]["cells"] if c["method"] != "ar"]
        for m in methods:
            xs = [st["history"] for st in stages]
            ys = [next(c for c in st["cells"] if c["method"] == m)["speedup_mean"] for st in stages]
            ax.plot(xs, ys, marker="o", label=m)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(d)
        ax.set_xlabel("governed responses in the tenant's history")
    axes[0][0].set_ylabel("× AR (mean of runs), C = 1")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "history_growth.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="drafters/smollm2")
    ap.add_argument("--domains", default="sql,edit,tools")
    ap.add_argument("--stages", default="0,32,128,256")
    ap.add_argument("--methods", default="ar,suffix,adaflash-cost")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/history-growth"))
    args = ap.parse_args()
    result = run(args)
    result["command"] = "python scripts/history_growth.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    result["spec"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    (args.out / "results.md").write_text(markdown(result))
    plot(result, args.out)
    print(f"wrote {args.out}/results.md")


if __name__ == "__main__":
    main()
