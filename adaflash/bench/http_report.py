"""`adaflash bench-http`'s outputs from its results (`bench.http_bench.run_http_bench`): results.json,
results.md (one table, every row against our in-process AR and our served AR, and issue 36's two
targets met or MISSED) and http.png (tok/s against C, one line per row)."""

from __future__ import annotations

import json
from pathlib import Path

INPROC = "in-process"


def _fmt(x, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _ms(x) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def rows(result: dict) -> list[dict]:
    """One row per (engine, method, C): the best run, the mean of runs, and the ratios."""
    out = []
    runs = result["runs"]

    def mean(e: str, m: str, c: str) -> float | None:
        cells = runs.get(e, {}).get(m, {}).get(c)
        return sum(x["tps"] for x in cells) / len(cells) if cells else None

    def best(e: str, m: str, c: str) -> float | None:
        cells = runs.get(e, {}).get(m, {}).get(c)
        return max(x["tps"] for x in cells) if cells else None

    for engine, methods in runs.items():
        for method, by_c in methods.items():
            for c, cells in by_c.items():
                top = max(cells, key=lambda x: x["tps"])
                row = {"engine": engine, "method": method, "concurrency": int(c), "best": top,
                       "tps_best": top["tps"], "tps_mean": mean(engine, method, c),
                       "tps_runs": [x["tps"] for x in cells]}  # fmt: skip
                for ref, key in ((INPROC, "inproc"), ("ours", "served")):
                    m, b = mean(ref, "ar", c), best(ref, "ar", c)
                    row[f"vs_{key}_ar_mean"] = row["tps_mean"] / m if m else None
                    row[f"vs_{key}_ar_best"] = row["tps_best"] / b if b else None
                row["identical_to_inproc_ar"] = _identical(result, f"{engine}/{method}", f"{INPROC}/ar", c)
                if engine.startswith("vllm-"):
                    row["identical_to_vllm_plain"] = _identical(result, f"{engine}/{method}", "vllm/ar", c)
                out.append(row)
    return sorted(out, key=lambda r: (r["concurrency"], _order(r["engine"]), r["method"]))


def _order(engine: str) -> int:
    names = [INPROC, "ours", "vllm", "vllm-dflash", "vllm-ngram", "vllm-suffix"]
    return names.index(engine) if engine in names else len(names)


def _identical(result: dict, a: str, b: str, c: str) -> str | None:
    """'n/N': how many answers of the first runs are the same token ids (None where either is missing
    or a server streamed no ids)."""
    x, y = result["outputs"].get(a, {}).get(c), result["outputs"].get(b, {}).get(c)
    if not x or not y or not all(x) or not all(y):
        return None
    return f"{sum(p == q for p, q in zip(x, y, strict=True))}/{len(x)}"


def targets(result: dict) -> list[str]:
    """Issue 36: served AR ≥ 90% of in-process AR at C = 1 and 8, and ≥ vLLM plain at C = 8 (means
    of runs)."""
    by = {(r["engine"], r["method"], r["concurrency"]): r for r in rows(result)}
    lines = []
    for c in (1, 8):
        r = by.get(("ours", "ar", c))
        if r and r["vs_inproc_ar_mean"] is not None:
            ok = "met" if r["vs_inproc_ar_mean"] >= 0.9 else "MISSED"
            lines.append(f"served AR / in-process AR at C = {c}: {r['vs_inproc_ar_mean']:.2f} by mean of "
                         f"runs ({r['vs_inproc_ar_best']:.2f} best run), target ≥ 0.90: {ok}")  # fmt: skip
    ours, vllm = by.get(("ours", "ar", 8)), by.get(("vllm", "ar", 8))
    if ours and vllm:
        ratio = ours["tps_mean"] / vllm["tps_mean"]
        lines.append(f"served AR / vLLM plain at C = 8: {ratio:.2f} by mean of runs, target ≥ 1.00: "
                     f"{'met' if ratio >= 1 else 'MISSED'}")  # fmt: skip
    return lines


def markdown(result: dict) -> str:
    spec = result["spec"]
    servers = result.get("servers", {})
    lines = [
        f"Target `{result['target']}`, drafter `{result['drafter']}` (k = {result['block_size']}), domain "
        f"`{spec['domain']}`, greedy, max {spec['max_new_tokens']} new tokens, `/v1/completions` on token "
        f"ids, streamed, closed loop (C clients, each sending its next prompt when its answer ends), "
        f"{spec['repeats']} runs per cell, the method order alternating.",
        f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores; every server at "
        f"niceness {spec['nice']}, one at a time; the client runs in the bench's process.",
        "Start-up (s): " + ", ".join(f"{k} {v['ready_s']:.0f}" for k, v in servers.items()),
        "",
        "`in-process` is our engine without HTTP (the `adaflash bench` cell, on the thread where our "
        "server steps its engine); `ours` is `adaflash serve`"
        + (f" with {spec['ours_env']}" if spec.get("ours_env") else "")
        + ". "
        "Ratios: mean of runs, then the best run's. `= AR`: answers (first run) with the same token ids "
        "as our in-process AR; `= vLLM`: as vLLM plain's (vLLM rows).",
        "",
        "| C | engine | method | tok/s best | tok/s mean | / in-process AR | / served AR | TTFT P50 ms "
        "| TPOT P50 ms | tok per server CPU-s | = AR | = vLLM |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows(result):
        b = r["best"]
        lines.append(
            f"| {r['concurrency']} | {r['engine']} | {r['method']} | {r['tps_best']:.2f} | "
            f"{r['tps_mean']:.2f} | "
            f"{_fmt(r['vs_inproc_ar_mean'])}x ({_fmt(r['vs_inproc_ar_best'])}x) | "
            f"{_fmt(r['vs_served_ar_mean'])}x ({_fmt(r['vs_served_ar_best'])}x) | "
            f"{_ms(b['ttft_s']['p50'])} | {_ms(b['tpot_s']['p50'])} | {_fmt(b.get('tps_server_cpu'), 1)} | "
            f"{r['identical_to_inproc_ar'] or '–'} | {r.get('identical_to_vllm_plain') or '–'} |"
        )
    lines += [f"Not run: {k} ({why})." for k, why in result.get("skipped", {}).items()]
    lines += ["", "Targets (issue 36):", ""] + [f"- {t}" for t in targets(result)]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows(result):
        series.setdefault(f"{r['engine']} {r['method']}", []).append((r["concurrency"], r["tps_mean"]))
    for label, pts in series.items():
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label.startswith(INPROC) else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients C")
    ax.set_ylabel("output tok/s (mean of runs)")
    ax.set_title("Through HTTP: ours and vLLM, same prompts and client")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "http.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result))
    (out / "results.md").write_text(markdown(result))
    return [out / "results.json", out / "results.md", plot(result, out)]
