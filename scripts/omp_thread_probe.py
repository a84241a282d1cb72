"""Does the thread that steps the engine change its speed? (`serve --step-loop`, issue 36)

Builds SmolLM2 + an AR engine on one thread and times AR cells (4 prompts x 64 tokens, C = 1) on
another, each in a fresh process, so that libgomp's thread count starts clean:

    python scripts/omp_thread_probe.py main main     # built and stepped on the main thread
    python scripts/omp_thread_probe.py main pool     # built on main, stepped on a worker thread
    python scripts/omp_thread_probe.py pool pool     # both on one worker thread
    GOMP_SPINCOUNT=3000 python scripts/omp_thread_probe.py main main

Prints the tok/s of 3 timed runs after one untimed one. Results: benchmarks/http/step-loop/README.md.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from adaflash.bench.serving import BenchSpec, bench_engine, run_cell
from adaflash.cli._common import load
from adaflash.workloads import default_data_dir


def main(build: str, run: str) -> None:
    pool = ThreadPoolExecutor(1)

    def on(where: str, f, *a):
        return f(*a) if where == "main" else pool.submit(f, *a).result()

    def build_all():
        tgt, _ = load("smollm2", None)
        text = (default_data_dir() / "README.md").read_text()[:3000]  # any fixed text: AR ignores it
        ids = tgt.tokenizer.encode(text)
        spec = BenchSpec(methods=["ar"], concurrency=[1], max_new_tokens=64)
        return bench_engine(tgt, None, spec, 200), [ids[i * 50 : i * 50 + 120] for i in range(4)]

    engine, prompts = on(build, build_all)

    def cell() -> float:
        c, _ = run_cell(engine, prompts, "ar", 1, 64)
        return round(c["tps"], 1)

    on(run, cell)  # untimed: first-call costs
    env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    print(json.dumps({"build": build, "run": run, "env": env, "tps": [on(run, cell) for _ in range(3)]}))


if __name__ == "__main__":
    if len(sys.argv) != 3 or not set(sys.argv[1:]) <= {"main", "pool"}:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
