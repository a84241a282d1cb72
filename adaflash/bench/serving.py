"""`adaflash bench`: methods × concurrency × domains on ONE engine, same prompts, one run.

Each cell drives the engine in-process with `concurrency` closed-loop clients (a client submits
its next prompt as soon as its previous one finishes) over the same held-out prompts, so
speedup = TPS(method) / TPS(ar) compares like with like. No HTTP in the loop: the bench measures
the engine, not uvicorn. Per cell: TPS (output tokens / wall time, prefill included), speedup vs
AR, τ (tokens per round incl. bonus), mean verified length k̂, P50/P95/P99 end-to-end latency,
TTFT, ITL (gaps between the token *chunks* a streaming client receives: a round's accepted
tokens arrive together) and TPOT, and how many outputs equal AR's.

Also (`bench.peers`): our AR against `transformers` `generate` at equal batch, transformers' and
llama.cpp's plain and prompt-lookup decoding at batch 1 on the same prompts, the machine's bounds,
peak RSS (after the grid; optionally of a real `adaflash serve` under C clients), and PNG plots
(`bench.serving_report`: speedup vs concurrency; acceptance by position; â vs a* from fixed k).
"""

from __future__ import annotations

import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from adaflash.bench import closed_loop
from adaflash.bench.peers import (
    gguf_path,
    hf_generate_tps,
    hf_lookup_rows,
    hf_model,
    llamacpp_available,
    llamacpp_tps,
    machine_bounds,
    roofline,
)
from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.targets import Target
from adaflash.serving.config import LOCKSTEP_MIN_PROB
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.protocol import ChatMessage, chat_prompt_ids
from adaflash.workloads import (
    DOMAINS,
    MESSAGE_SETS,
    Prompt,
    interleave,
    load_prompts,
    message_prompts,
    message_set,
)

# Method name suffixes: the same method with a fast learner switched off for its requests.
NOCACHE = "-nocache"  # no drafts from the suffix cache
NOPREFIX = "-noprefix"  # no reuse of cached prompt heads (prefill every prompt whole)


def split_label(label: str) -> tuple[str, bool, bool]:
    """A method label -> (engine method, suffix cache on, prefix cache on)."""
    method, suffix, prefix = label, True, True
    while method.endswith((NOCACHE, NOPREFIX)):
        if method.endswith(NOCACHE):
            method, suffix = method.removesuffix(NOCACHE), False
        else:
            method, prefix = method.removesuffix(NOPREFIX), False
    return method, suffix, prefix


@dataclass
class BenchSpec:
    methods: list[str] = field(default_factory=lambda: ["ar", "dflash", "adaflash"])
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    domains: list[str] = field(default_factory=lambda: ["math", "code", "chat", "blend"])
    prompts_per_cell: int = 0  # 0: max(concurrency, min_prompts)
    min_prompts: int = 4
    max_new_tokens: int = 64
    gamma: float = 1.0
    probe_every: int = 1  # EngineConfig.probe_every (1 = the published method)
    lockstep_min_prob: float = LOCKSTEP_MIN_PROB  # EngineConfig.lockstep_min_prob (0: off)
    hf_baseline: bool = True
    llamacpp: bool = True  # llama.cpp at C = 1 when llama-cpp-python is installed (else a note)
    bounds: bool = True  # the machine's bandwidth/matmul bounds and our AR's fraction of them
    repeats: int = 1  # runs per cell (alternating method order); the fastest stands for the cell
    data_dir: Path | None = None
    # Production-like traffic: a prompt file (JSONL with `messages`, its own domain "file"), and
    # the suffix cache's warm-up: each domain's first `warm` prompts are served, governed and
    # learned before its cells are timed (on the remaining prompts only). 0: a cold cache.
    prompts_file: Path | None = None
    warm: int = 48
    max_prompt_tokens: int = 1024  # longer prompts are left out (prefill would dominate a cell)


def _dist(xs: list[float]) -> dict[str, float | None]:
    """P50 / P95 / P99 and the mean (a C = 1 cell's wall is the sum of its requests' e2e)."""
    q = [float(v) for v in np.percentile(xs, [50, 95, 99])] if xs else [None] * 3
    return {"p50": q[0], "p95": q[1], "p99": q[2], "mean": float(np.mean(xs)) if xs else None}


def workload(target: Target, spec: BenchSpec, n: int) -> dict[str, list[tuple[str, list[int]]]]:
    """Per domain, `spec.warm` warm-up prompts then `n` timed ones: held-out prompts for math /
    code / chat / blend (the last ones: bootstrap evaluation uses the first), the sets' fixed
    shuffle for the production-like domains, the file's order for `--prompts`."""
    held = load_prompts("heldout", spec.data_dir) if set(spec.domains) & {*DOMAINS, "blend"} else {}
    out = {}
    for d in spec.domains:
        if d == "blend":
            rows = interleave({k: [p for p in reversed(held[k])] for k in DOMAINS})
        elif d in DOMAINS:
            rows = list(reversed(held[d]))
        elif d in MESSAGE_SETS:
            rows = message_set(d, spec.data_dir)
        elif d == "file" and spec.prompts_file is not None:
            rows = message_prompts(Path(spec.prompts_file), "file")
        else:
            raise ValueError(f"unknown domain {d!r}")
        ids = []
        for p in rows:
            x = prompt_ids(target, p)
            if len(x) <= spec.max_prompt_tokens:
                ids.append((p.id, x))
            if len(ids) >= spec.warm + n:
                break
        out[d] = ids
    return out


def prompt_ids(target: Target, p: Prompt) -> list[int]:
    """A prompt's chat-templated token ids (its `messages` where it has them)."""
    if p.messages:
        msgs = [ChatMessage(role=m["role"], content=m["content"]) for m in p.messages]
        return chat_prompt_ids(target.tokenizer, msgs)
    return target.tokenizer.chat_prompt(p.text)


def run_cell(
    engine: Engine,
    prompts: list[list[int]],
    method: str,
    concurrency: int,
    max_new: int,
    tenant: str | list[str] = "bench",
    prefix_state: dict | None = None,
) -> tuple[dict, list[list[int]]]:
    """One timed closed-loop run. `tenant`: every request's, or one per prompt. `prefix_state`:
    the prefix cache's contents to start from (a `PrefixCache.snapshot`), so that no run reuses
    the heads an earlier run of the same prompts left."""
    tenants = iter([tenant] * len(prompts) if isinstance(tenant, str) else tenant)  # closed_loop keeps order
    label = method
    method, suffix_on, prefix_on = split_label(label)
    cache = engine.suffix_cache.config
    enabled, cache.enabled = cache.enabled, cache.enabled and suffix_on
    if prefix_state is not None:
        engine.prefix_cache.restore(prefix_state)

    def make(ids: list[int]) -> Request:
        params = GenParams(max_new, 0.0, method=method)
        return Request(ids, params, tenant_id=next(tenants), use_prefix_cache=prefix_on)

    try:
        t0, cpu0 = time.perf_counter(), time.process_time()
        reqs, steps = closed_loop.serve(engine, prompts, make, concurrency)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        cache.enabled = enabled
    rounds = [rd for r in reqs for rd in r.rounds]
    tokens = sum(len(r.output_ids) for r in reqs)
    chunk_gaps: list[float] = []
    for r in reqs:
        times = sorted(set(r.token_times))
        chunk_gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    tpot = [(r.e2e - r.ttft) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    e2e = [r.e2e for r in reqs]
    ttft = [r.ttft for r in reqs]
    cell = {
        "method": label,
        "concurrency": concurrency,
        "requests": len(reqs),
        "output_tokens": tokens,
        "steps": steps,
        "wall_s": wall,
        # CPU seconds / wall seconds of this process: < torch threads means something else ran.
        "cpu_share": cpu / wall,
        "tps": tokens / wall,
        # Tokens per CPU-second of this process: with one torch thread, what a time-sliced (shared)
        # machine does not distort; memory-bandwidth contention still does.
        "tps_cpu": tokens / max(cpu, 1e-9),
        "tau": sum(rd.accepted + 1 for rd in rounds) / max(len(rounds), 1),
        "mean_verify_len": sum(rd.verify_len for rd in rounds) / max(len(rounds), 1),
        "ttft_s": _dist(ttft),
        "e2e_s": _dist(e2e),
        "itl_s": _dist(chunk_gaps),
        "tpot_s": _dist(tpot),
        "rounds": [(rd.verify_len, rd.accepted, rd.a_hat) for rd in rounds],
        # Who proposed, in rounds and in accepted drafts: how the speed splits between learners.
        "proposers": {
            p: {
                "rounds": sum(rd.proposer == p for rd in rounds),
                "accepted": sum(rd.accepted for rd in rounds if rd.proposer == p),
            }
            for p in sorted({rd.proposer for rd in rounds})
        },  # fmt: skip
    }
    return cell, [r.output_ids for r in reqs]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(target: Target, bundle: DrafterBundle | None, spec: BenchSpec, log=print) -> dict:
    n_cell = {c: spec.prompts_per_cell or max(c, spec.min_prompts) for c in spec.concurrency}
    every = workload(target, spec, max(n_cell.values()))
    warm = {d: rows[: spec.warm] if len(rows) > spec.warm else [] for d, rows in every.items()}
    prompts = {d: rows[len(warm[d]) :] for d, rows in every.items()}
    longest = max(len(ids) for rows in every.values() for _, ids in rows)
    engine = bench_engine(target, bundle, spec, longest)  # packs its weights as it is built
    cells = []
    warmups, prefix = {}, {}
    for domain in spec.domains:
        if warm[domain]:
            warmups[domain] = warm_domain(engine, spec, domain, [ids for _, ids in warm[domain]], log)
        # Every run of the domain starts from what the warm-up left in the prefix cache.
        base = engine.prefix_cache.snapshot()
        prefix[domain] = {
            k: v for k, v in engine.prefix_cache.stats().items() if k in ("blocks", "tokens", "bytes")
        }
        for conc in spec.concurrency:
            rows = [ids for _, ids in prompts[domain][: n_cell[conc]]]
            cells += domain_cells(engine, spec, domain, conc, rows, log, base)
    add_speedups(cells)
    result = {
        "spec": {
            **asdict(spec),
            "data_dir": str(spec.data_dir) if spec.data_dir else None,
            "prompts_file": str(spec.prompts_file) if spec.prompts_file else None,
        },
        "target": target.name,
        "drafter": str(bundle.path) if bundle is not None and bundle.path else None,
        "block_size": bundle.config.block_size if bundle else None,
        "dtype": str(target.model.dtype),
        "machine": machine(),
        "cells": cells,
        "peak_rss_mb_after_grid": peak_rss_mb(),
        "prompts": {d: [pid for pid, _ in rows] for d, rows in prompts.items()},
        "warmup": {
            "prompts": {d: [pid for pid, _ in rows] for d, rows in warm.items()},
            "governed": warmups,
            "prefix_cache": prefix,  # what every timed run starts from
        },
    }
    result.update(peer_rows(target, bundle, spec, prompts, n_cell, cells, log))
    return result


def bench_engine(target: Target, bundle: DrafterBundle | None, spec: BenchSpec, longest: int) -> Engine:
    """One engine for every cell: room for the largest concurrency and the longest prompt."""
    return Engine(
        target,
        bundle,
        EngineConfig(
            method=split_label(spec.methods[-1])[0],
            gamma=spec.gamma,
            max_running=max(spec.concurrency),
            max_queue=max(max(spec.concurrency), 8),
            max_model_len=longest + spec.max_new_tokens + 1,
            step_token_budget=max(spec.concurrency) * (bundle.config.block_size if bundle else 1),
            shadow_a_hat=True,
            probe_every=spec.probe_every,
            lockstep_min_prob=spec.lockstep_min_prob,
        ),
        drafter_version=str(bundle.path) if bundle is not None and bundle.path else None,
    )


def warm_domain(engine: Engine, spec: BenchSpec, domain: str, rows: list[list[int]], log) -> dict:
    """Serve and govern a domain's warm-up prompts so that its suffix cache holds them."""
    from adaflash.bench.warmup import warm_suffix_cache  # governance: Presidio loads on first use

    log(f"{domain}: warming the suffix cache with {len(rows)} served + governed prompts ...")
    w = warm_suffix_cache(engine, rows, f"bench-{domain}", spec.max_new_tokens)
    why = w["quarantined"] or "none"
    log(
        f"{domain}: {w['clean']}/{w['served']} clean, learned {w['learned']}, quarantined {why} "
        f"(served in {w['serve_s']:.0f} s, governed in {w['govern_s']:.0f} s)"
    )
    return w


def domain_cells(engine: Engine, spec: BenchSpec, domain: str, conc: int, rows: list[list[int]],
                 log, prefix_state: dict | None = None) -> list[dict]:  # fmt: skip
    """One cell per method at concurrency `conc` on `rows`: `spec.repeats` runs each."""
    runs: dict[str, list[tuple[dict, list[list[int]]]]] = {m: [] for m in spec.methods}
    # Repeats alternate the method order (forward, reversed, ...) so that a drift of the
    # machine's speed does not favour whichever method runs first.
    for rep in range(spec.repeats):
        for method in spec.methods if rep % 2 == 0 else spec.methods[::-1]:
            runs[method].append(
                run_cell(engine, rows, method, conc, spec.max_new_tokens, f"bench-{domain}", prefix_state)
            )
    cells = []
    for method in spec.methods:
        # The fastest run stands for the cell: on a shared machine noise only slows a run.
        cell, _ = max(runs[method], key=lambda run: run[0]["tps"])
        cell["domain"] = domain
        cell["tps_runs"] = [c["tps"] for c, _ in runs[method]]
        cell["tps_mean"] = sum(cell["tps_runs"]) / len(cell["tps_runs"])
        if "ar" in runs:  # every run of every method, against AR's first
            ref = runs["ar"][0][1]
            cell["identical_to_ar"] = min(
                sum(a == b for a, b in zip(outs, ref, strict=True)) for _, outs in runs[method]
            )
        cells.append(cell)
        log(
            f"{domain:6s} C={conc:<3d} {method:9s} {cell['tps']:8.2f} tok/s  τ={cell['tau']:.3f}  "
            f"k̂={cell['mean_verify_len']:.2f}  wall={cell['wall_s']:.1f}s  "
            f"cpu={cell['cpu_share']:.2f}  runs={'/'.join(f'{t:.1f}' for t in cell['tps_runs'])}"
        )
    return cells


def add_speedups(cells: list[dict]) -> None:
    """Each cell's speed-ups against AR's cell of the same domain and concurrency."""
    ars = {(x["domain"], x["concurrency"]): x for x in cells if x["method"] == "ar"}
    for c in cells:
        ar = ars.get((c["domain"], c["concurrency"]))
        c["speedup_vs_ar"] = c["tps"] / ar["tps"] if ar else None
        # The mean of runs beside the best run's ratio (a bar met only by the best run is not met).
        c["speedup_mean_vs_ar"] = c["tps_mean"] / ar["tps_mean"] if ar else None
        c["speedup_cpu_vs_ar"] = c["tps_cpu"] / ar["tps_cpu"] if ar else None


def peer_rows(target: Target, bundle, spec: BenchSpec, prompts: dict, n_cell: dict, cells: list[dict],
              log) -> dict:  # fmt: skip
    """What our AR is measured against: transformers.generate, the machine's bounds, llama.cpp."""
    result: dict = {}
    ours = {(c["domain"], c["concurrency"], c["method"]): c for c in cells}
    if spec.hf_baseline and "ar" in spec.methods:
        log("transformers.generate baseline ...")
        model = hf_model(target)
        dom = "blend" if "blend" in prompts else spec.domains[0]
        base, plain = [], {}
        for conc in spec.concurrency:
            rows = [ids for _, ids in prompts[dom][: n_cell[conc]]]
            hf = hf_generate_tps(model, target, rows, conc, spec.max_new_tokens)
            plain.update({dom: hf} if conc == 1 else {})  # the batch-1 peer rows' prompts: not rerun
            ar = ours[(dom, conc, "ar")]
            base.append({**hf, "domain": dom, "ours_ar_tps": ar["tps"], "ratio": ar["tps"] / hf["tps"]})
            log(f"HF generate batch {conc}: {hf['tps']:.2f} tok/s vs our AR {ar['tps']:.2f}")
        result["hf_baseline"] = base
        if 1 in spec.concurrency:  # transformers' prompt lookup, the model-free peer of ours
            log("transformers prompt lookup at batch 1 ...")
            c1 = {d: [ids for _, ids in prompts[d][: n_cell[1]]] for d in spec.domains}
            means = {d: {m: c["tps_mean"] for (dd, cc, m), c in ours.items() if (dd, cc) == (d, 1)}
                     for d in c1}  # fmt: skip
            k = bundle.config.block_size if bundle is not None else 8  # the same draft length as ours
            result["hf_lookup"] = hf_lookup_rows(model, target, c1, spec.max_new_tokens, k, means, plain)
    if spec.bounds and "ar" in spec.methods:
        log("machine bounds (read bandwidth, matmul) ...")
        dom = "blend" if "blend" in prompts else spec.domains[0]
        # Decode throughput (C / TPOT P50, gpt-fast's view): prefill is neither a weight stream
        # per output token nor counted in output tokens.
        tpot = {c: (ours.get((dom, c, "ar")) or {}).get("tpot_s", {}).get("p50") for c in (1, 32)}
        c1, c32 = (c / tpot[c] if tpot[c] else None for c in (1, 32))
        result["roofline"] = {"domain": dom, **roofline(target, c1, c32, machine_bounds(target.model.dtype))}
    if spec.llamacpp and "ar" in spec.methods and 1 in spec.concurrency:
        result["llamacpp"] = llamacpp_rows(target, bundle, spec, prompts, n_cell[1], ours, log)
    return result


def llamacpp_rows(target, bundle, spec: BenchSpec, prompts, n: int, ours: dict, log) -> dict:
    """llama.cpp plain and prompt-lookup decoding at batch 1, per domain, next to our C = 1 cells."""
    gguf = gguf_path(target)
    why = llamacpp_available() or (None if gguf else f"target {target.name!r} has no GGUF file")
    if why:
        log(f"llama.cpp peer skipped: {why}")
        return {"skipped": why}
    lookup = bundle.config.block_size if bundle is not None else 8  # the same draft length as ours
    rows = []
    for dom in spec.domains:
        ids = [p for _, p in prompts[dom][:n]]
        for k in (0, lookup):
            row = llamacpp_tps(gguf, ids, spec.max_new_tokens, torch.get_num_threads(), k)
            row["domain"] = dom
            row["ours"] = {m: ours[(dom, 1, m)]["tps_mean"] for m in spec.methods if (dom, 1, m) in ours}
            rows.append(row)
            log(f"{dom:6s} C=1   {row['peer']:28s} {row['tps']:8.2f} tok/s")
    return {"rows": rows}


def machine() -> dict:
    import os

    cpu = ""
    try:
        cpu = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if "model name" in ln
            ),
            "",
        )
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def serve_peak_rss(
    target: str, drafter: Path | None, prompts: list[str], concurrency: int, max_tokens: int, log=print
) -> dict:
    """Start a real `adaflash serve`, hit it with `concurrency` clients, read its VmHWM."""
    import asyncio
    import os

    import httpx

    from adaflash.feedback.broker import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "adaflash.cli",
        "serve",
        "--target",
        target,
        "--port",
        str(port),
        "--max-running",
        str(concurrency),
        "--max-queue",
        str(concurrency),
    ]
    cmd += ["--drafter", str(drafter)] if drafter is not None else ["--method", "ar"]
    env = {**os.environ, "ADAFLASH_ADMIN_TOKEN": ""}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"adaflash serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("adaflash serve did not come up in 300 s")
            time.sleep(0.5)
        rss_idle = _vm(proc.pid, "VmRSS")

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=1200) as c:
                body = {"max_tokens": max_tokens, "temperature": 0}
                return await asyncio.gather(
                    *(
                        c.post(
                            "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": p}], **body},
                        )
                        for p in prompts[:concurrency]
                    )
                )

        t0 = time.perf_counter()
        codes = [r.status_code for r in asyncio.run(burst())]
        wall = time.perf_counter() - t0
        out = {
            "concurrency": concurrency,
            "codes": sorted(set(codes)),
            "wall_s": wall,
            "rss_idle_mb": rss_idle,
            "peak_rss_mb": _vm(proc.pid, "VmHWM"),
        }
        log(f"serve at C={concurrency}: peak RSS {out['peak_rss_mb']:.0f} MB (idle {rss_idle:.0f} MB)")
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _vm(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")
