"""What one more verified row costs: one request's target forward + LM head at a long context, by rows.

At C = 1 a speculative round verifies k̂ + 1 rows of one request where an AR step runs one. On a
memory-bound model the extra rows would be nearly free; on this CPU they are not, and the cost
policy prices them through its measured curves. This probe says where the extra time goes: the
request sits at `--context` committed tokens, and each width (rows) is timed over the engine's
packed runner (`serving/runner.py`: our C kernels for an fp32 target), round-robin, `--repeats`
times, best and median kept; each kernel family's share (the row-wise linears, the slot attention,
the row ops, the LM head) is timed inside the same calls.

    ADAFLASH_CACHE=.cache/adaflash python scripts/profile_verify.py --context 800 --out benchmarks/verify-cost

Writes results.json and results.md under --out. Wall time: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from adaflash.models import packed, row_ops, slot_attention
from adaflash.models.targets import load_target
from adaflash.serving.runner import PackedBatch, PackedRunner, Segment

SPLIT: dict[str, float] = defaultdict(float)


def _timed(owner: object, name: str, key: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        SPLIT[key] += time.perf_counter() - t
        return out

    setattr(owner, name, wrapper)


def measure(target: str, context: int, widths: list[int], repeats: int) -> dict:
    model = load_target(target).model
    kernels = [
        (packed.FrozenLinear, "__call__", "linears"),
        (slot_attention, "attend", "attention"),
        (row_ops, "add_rms_norm", "row ops"),
        (row_ops, "silu_mul", "row ops"),
        (model, "logits", "LM head"),
    ]
    for owner, name, key in kernels:
        _timed(owner, name, key)
    runner = PackedRunner(model, 1, context + max(widths) + 1)
    times: dict[int, list[float]] = defaultdict(list)
    split: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with torch.no_grad():
        runner.forward(PackedBatch.build([Segment(0, 0, [1] * context)]))
        for rep in range(repeats + 2):
            for w in widths:
                batch = PackedBatch.build([Segment(0, context, [5] * w)])
                SPLIT.clear()
                t = time.perf_counter()
                model.logits(runner.forward(batch)[0])
                if rep >= 2:  # two warm-up rounds
                    times[w].append(time.perf_counter() - t)
                    for k, v in SPLIT.items():
                        split[w][k].append(v)
    base = min(times[widths[0]])
    rows = {}
    for w in widths:
        rows[w] = {
            "best_ms": round(1e3 * min(times[w]), 2),
            "median_ms": round(1e3 * statistics.median(times[w]), 2),
            "x_first_width_best": round(min(times[w]) / base, 3),
            "median_ms_by_kernel": {k: round(1e3 * statistics.median(v), 2) for k, v in split[w].items()},
        }
    return {"target": target, "context": context, "threads": torch.get_num_threads(), "repeats": repeats,
            "rows": rows}  # fmt: skip


def markdown(r: dict) -> str:
    kernels = list(next(iter(r["rows"].values()))["median_ms_by_kernel"])
    lines = [
        f"# One request's verify forward at {r['context']} tokens of context: {r['target']}, "
        f"{r['threads']} thread(s), {r['repeats']} runs a width",
        "",
        "| rows | best ms | median ms | × 1 row (best) | " + " | ".join(f"{k} ms" for k in kernels) + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(kernels),
    ]
    for w, row in r["rows"].items():
        split = " | ".join(f"{row['median_ms_by_kernel'].get(k, 0):.2f}" for k in kernels)
        head = f"| {w} | {row['best_ms']} | {row['median_ms']} | {row['x_first_width_best']}"
        lines.append(f"{head} | {split} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--widths", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/verify-cost"))
    args = ap.parse_args()
    result = measure(args.target, args.context, [int(w) for w in args.widths.split(",")], args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    (args.out / "results.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
