"""Where a decode step's time goes: the target's packed forward + LM head, split by stage and op.

For each concurrency C, C requests sit at `--context` committed tokens and the step decodes one
token each (the AR step of the engine's runner, `serving/runner.py`). Measured, best of
`--repeats` blocks of 10 steps:

* the whole step (forward + LM head on the C rows);
* the step with every linear layer memoised (each call returns its previous output): what the
  norms, RoPE, KV writes, attention, activations and Python cost;
* the linear layers alone, replaying the step's calls in order: what the weights cost;
* their achieved weight bandwidth (GB/s) and GFLOP/s next to the machine's bounds measured in
  the same process (`bench.peers.machine_bounds`);
* the top ops by self CPU time (torch.profiler) over 10 real steps.

    python scripts/profile_step.py --target smollm2 --concurrency 1,8,32 --out benchmarks/step-profile

Writes results.json and results.md under --out. Numbers are this machine's, at the torch thread
count of `ADAFLASH_THREADS` (default: torch's).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from adaflash.bench.peers import machine_bounds
from adaflash.models import packed
from adaflash.models.targets import load_target
from adaflash.serving.runner import PackedBatch, PackedRunner, Segment


def _best_ms(fn, repeats: int, inner: int = 10) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1e3


def profile(target, concurrency: int, context: int, repeats: int, top: int) -> dict:
    m = target.model
    runner = PackedRunner(m, concurrency, context + 64)
    for s in range(concurrency):
        runner.forward(PackedBatch.build([Segment(s, 0, [1 + s] * context)]))
    segments = [Segment(s, context, [5]) for s in range(concurrency)]

    def step() -> None:
        hidden, _ = runner.forward(PackedBatch.build(segments))
        m.logits(hidden)

    full = _best_ms(step, repeats)
    calls: list[tuple[packed.FrozenLinear, torch.Tensor]] = []
    real_call = packed.FrozenLinear.__call__
    memo: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def recording(self, x):
        calls.append((self, x.clone()))
        return real_call(self, x)

    def memoised(self, x):
        key = (id(self), tuple(x.shape))
        if key not in memo:
            memo[key] = real_call(self, x)
        return memo[key]

    try:
        packed.FrozenLinear.__call__ = recording
        step()
        packed.FrozenLinear.__call__ = memoised
        without_linears = _best_ms(step, repeats)
    finally:
        packed.FrozenLinear.__call__ = real_call

    def linears() -> None:
        for f, x in calls:
            f(x)

    linears_ms = _best_ms(linears, repeats)
    weight_bytes = sum(f.weight.numel() * f.weight.element_size() for f, _ in calls)
    flops = 2 * concurrency * sum(f.weight.numel() for f, _ in calls)
    from torch.profiler import profile as torch_profile

    with torch_profile() as prof:
        for _ in range(10):
            step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "concurrency": concurrency,
        "context": context,
        "step_ms": full,
        "without_linears_ms": without_linears,
        "linears_ms": linears_ms,
        "linear_calls": len(calls),
        "linear_weight_bytes": weight_bytes,
        "linears_gbs": weight_bytes / linears_ms / 1e6,
        "linears_gflops": flops / linears_ms / 1e6,
        "top_ops": [
            {"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e4, "calls_per_step": e.count / 10}
            for e in ops  # 10 steps profiled; self_cpu_time_total is in µs
        ],
    }


def markdown(result: dict) -> str:
    b = result["bounds"]
    lines = [
        f"# Decode step profile: {result['target']}, {b['threads']} threads",
        "",
        f"Machine bounds in the same process: read bandwidth {b['read_bandwidth_gbs']:.1f} GB/s, "
        f"fp32 matmul {b['matmul_gflops']:.0f} GFLOP/s.",
        "",
        "| C | step ms | linears alone ms | all but linears ms | linears GB/s (of bound) | linears GFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['step_ms']:.1f} | {r['linears_ms']:.1f} "
            f"| {r['without_linears_ms']:.1f} "
            f"| {r['linears_gbs']:.1f} ({r['linears_gbs'] / b['read_bandwidth_gbs']:.0%}) "
            f"| {r['linears_gflops']:.0f} |"
        )
    for r in result["rows"]:
        lines += ["", f"Top ops at C = {r['concurrency']} (self CPU ms per step, calls per step):", ""]
        lines += [f"- `{o['op']}`: {o['self_ms_per_step']:.2f} ms, {o['calls_per_step']:.0f}"
                  for o in r["top_ops"]]  # fmt: skip
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/step-profile"))
    args = ap.parse_args()
    if threads := os.environ.get("ADAFLASH_THREADS"):
        torch.set_num_threads(int(threads))
    target = load_target(args.target)
    rows = []
    with torch.no_grad():
        for c in (int(x) for x in args.concurrency.split(",")):
            rows.append(profile(target, c, args.context, args.repeats, args.top))
            r = rows[-1]
            print(f"C={c}: step {r['step_ms']:.1f} ms = linears {r['linears_ms']:.1f} + rest "
                  f"{r['without_linears_ms']:.1f} (linears {r['linears_gbs']:.1f} GB/s)")  # fmt: skip
    result = {
        "target": args.target,
        "bounds": machine_bounds(),
        "rows": rows,
        "command": "python scripts/profile_step.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    (args.out / "results.md").write_text(markdown(result))
    print(f"wrote {args.out}/results.md")


if __name__ == "__main__":
    main()
