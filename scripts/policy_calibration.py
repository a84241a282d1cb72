"""How far `adaflash-cost`'s estimates hold on served traffic: the diagnosis behind its choices.

Per domain, one engine warmed like `adaflash bench --warm N` (served, governed, learned), then the
next `--prompts` prompts served at C = 1 with `adaflash-cost`, `--repeats` times. Every verified
round is logged with the option the policy chose (proposer, drafts, the accepted drafts it
expected) and what verification accepted; every decode step with the target seconds the cost
curve predicted for its rows and the seconds it measured (the policy's clock: process CPU time).

    python scripts/policy_calibration.py --domains edit,sql --warm 32 --prompts 6 \\
        --out benchmarks/policy-calibration

Writes results.json and results.md: per proposer, accepted over expected drafts (1.0: calibrated);
per verified-row count, measured over predicted seconds; the overhead per step outside the target.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from adaflash.bench.serving import BenchSpec, bench_engine, run_cell, warm_domain, workload
from adaflash.models.checkpoint import load_drafter_for
from adaflash.models.targets import load_target


def instrument(policy) -> dict:
    """Wrap the policy's feedback calls to log rounds and steps into the returned dict."""
    log: dict = {"rounds": [], "steps": []}
    observe, observe_step = policy.observe, policy.observe_step

    def logged_observe(decoding, plan, accepted, nxt):
        for i, r in enumerate(decoding):
            o = policy.last_options[i] if i < len(policy.last_options) else None
            drafts = plan.khat[i] - 1
            if r.method == "adaflash-cost" and drafts > 0 and o is not None:
                log["rounds"].append((plan.proposer[i], drafts, o.expected, accepted[i]))
        return observe(decoding, plan, accepted, nxt)

    def logged_step(rows, target_seconds, step_seconds, plan, emitted, prefill, requests=1):
        if not prefill:
            predicted = policy.costs.target(rows, requests)
            log["steps"].append((rows, requests, predicted, target_seconds, step_seconds))
        return observe_step(rows, target_seconds, step_seconds, plan, emitted, prefill, requests)

    policy.observe, policy.observe_step = logged_observe, logged_step
    return log


def summarise(log: dict) -> dict:
    by_proposer: dict = defaultdict(lambda: {"rounds": 0, "drafts": 0, "expected": 0.0, "accepted": 0})
    for p, drafts, expected, accepted in log["rounds"]:
        s = by_proposer[p]
        s["rounds"] += 1
        s["drafts"] += drafts
        s["expected"] += expected
        s["accepted"] += accepted
    for s in by_proposer.values():
        s["accepted_over_expected"] = s["accepted"] / s["expected"] if s["expected"] else None
        s["accepted_per_draft"] = s["accepted"] / s["drafts"] if s["drafts"] else None
    by_rows: dict = defaultdict(lambda: {"steps": 0, "predicted": 0.0, "measured": 0.0})
    overhead = []
    for rows, _, predicted, target_s, step_s in log["steps"]:
        s = by_rows[min(rows, 9)]  # 9: nine rows or more
        s["steps"] += 1
        s["predicted"] += predicted
        s["measured"] += target_s
        overhead.append(step_s - target_s)
    for s in by_rows.values():
        s["measured_over_predicted"] = s["measured"] / s["predicted"] if s["predicted"] else None
        s["mean_measured_ms"] = 1e3 * s["measured"] / s["steps"]
    return {
        "proposers": dict(by_proposer),
        "rows": {k: by_rows[k] for k in sorted(by_rows)},
        "mean_outside_target_ms": 1e3 * sum(overhead) / max(len(overhead), 1),
    }


def run(args) -> dict:
    target = load_target(args.target)
    bundle = load_drafter_for(args.drafter, target)
    spec = BenchSpec(
        methods=["adaflash-cost"],
        concurrency=[1],
        domains=args.domains.split(","),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warm=args.warm,
        hf_baseline=False,
        llamacpp=False,
        bounds=False,
    )
    every = workload(target, spec, args.prompts)
    longest = max(len(ids) for rows in every.values() for _, ids in rows)
    out: dict = {"domains": {}}
    for domain in spec.domains:
        rows = [ids for _, ids in every[domain]]
        warm, timed = rows[: args.warm], rows[args.warm : args.warm + args.prompts]
        engine = bench_engine(target, bundle, spec, longest)
        warm_domain(engine, spec, domain, warm, print)
        prefix = engine.prefix_cache.snapshot()
        log = instrument(engine.policy)
        tps = []
        for _ in range(args.repeats):
            tenant = f"bench-{domain}"
            cell, _ = run_cell(engine, timed, "adaflash-cost", 1, args.max_new_tokens, tenant, prefix)
            tps.append(cell["tps"])
        out["domains"][domain] = {"tps_runs": tps, **summarise(log)}
        print(domain, json.dumps(out["domains"][domain]["proposers"], indent=1))
    return out


def markdown(result: dict) -> str:
    lines = ["# adaflash-cost's estimates against what happened (C = 1)", ""]
    for domain, r in result["domains"].items():
        lines += [
            f"## {domain}",
            "",
            "| proposer | rounds | drafts | expected accepted | accepted | accepted / expected | per draft |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for p, s in r["proposers"].items():
            ratio = f"{s['accepted_over_expected']:.2f}" if s["accepted_over_expected"] is not None else "-"
            lines.append(
                f"| {p} | {s['rounds']} | {s['drafts']} | {s['expected']:.1f} | {s['accepted']} | {ratio} "
                f"| {s['accepted_per_draft']:.2f} |"
            )
        lines += ["", "| verified rows | steps | measured ms | measured / predicted |"]
        lines += ["|---:|---:|---:|---:|"]
        for rows, s in r["rows"].items():
            label = f"{rows}+" if int(rows) == 9 else str(rows)
            ratio = s["measured_over_predicted"]
            lines.append(
                f"| {label} | {s['steps']} | {s['mean_measured_ms']:.1f} | {ratio:.2f} |"
                if ratio
                else f"| {label} | {s['steps']} | {s['mean_measured_ms']:.1f} | - |"
            )
        lines += ["", f"Outside the target forward: {r['mean_outside_target_ms']:.1f} ms a step.", ""]
    lines += [f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default="drafters/smollm2")
    ap.add_argument("--domains", default="edit,sql")
    ap.add_argument("--warm", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/policy-calibration"))
    args = ap.parse_args()
    result = run(args)
    result["command"] = "python scripts/policy_calibration.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    (args.out / "results.md").write_text(markdown(result))
    print(f"wrote {args.out}/results.json and results.md")


if __name__ == "__main__":
    main()
