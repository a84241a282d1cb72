"""`adaflash bench-http`: what users get — every engine timed through its OpenAI HTTP API, one run.

Servers start one after another, each once for all of its cells: our `adaflash serve` (rows `ar`
and `adaflash-cost`, chosen per request by the body's `method`), then vLLM plain, vLLM with our
drafter exported for it (DFlash), vLLM `ngram` and vLLM `suffix`. One client drives every server the
same way: `/v1/completions` with the prompt as token ids (no server-side template: every engine sees
the same ids), greedy, the same `max_tokens`, streamed, at each concurrency C a closed loop (C
clients, each sending its next prompt as soon as its previous answer has ended). The same run also
times our engine in-process (`bench.serving.run_cell`, no HTTP) on the same prompts, so the table
shows served AR / in-process AR.

Per run: output tokens / wall time (the server's `usage`), TTFT (first streamed token), TPOT
((end - first token) / (tokens - 1)), and the server's CPU seconds. Each cell runs `repeats` times,
the method order alternating; the table shows the best run and the mean of runs. Every (C, run)
has prompts of its own, never sent to any server before (the same ones for every engine): a server
that learns from what it served (vLLM `suffix`'s global tree) must not be timed on answers it has
already seen. Outputs are
compared by token id with the in-process AR's (every row), and each vLLM row with vLLM plain's too.

Resumable: results.json is written after every (server, C) block; a rerun with the same options
skips the blocks it holds, and starts no server whose blocks are all there.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from adaflash.bench import http_servers as hs
from adaflash.bench.http_report import INPROC, markdown
from adaflash.bench.serving import BenchSpec, bench_engine, machine, run_cell, workload
from adaflash.errors import AdaFlashError, InputError
from adaflash.feedback.broker import free_port

PROFILE_RATE = 100  # py-spy samples per second


Prompts = list[list[int]]  # token ids, one list per prompt
WARM_PROMPTS = 2  # the first prompts warm each server up (untimed); no timed run sees them


@dataclass
class HttpSpec:
    target: str = "smollm2"  # as `adaflash serve --target` takes it
    engines: list[str] = field(default_factory=lambda: list(hs.ENGINES))
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    domain: str = "blend"
    prompts_per_cell: int = 0  # 0: max(2 C, min_prompts): every client sends at least two prompts
    min_prompts: int = 8
    max_new_tokens: int = 64
    repeats: int = 3
    nice: int = 0  # every server's niceness (the same for all: a fair share of the cores)
    profile: bool = False  # py-spy on our server: one extra, untimed AR run at C = 1 and C = 8
    data_dir: str | None = None
    max_prompt_tokens: int = 1024
    work: str = ".adaflash/bench-http"  # server logs and the drafter exported for vLLM (not results)
    # Extra environment of our server only (an A/B of its threading: ADAFLASH_THREADS=1,
    # OMP_WAIT_POLICY=ACTIVE, ... against the same in-process rows).
    ours_env: dict[str, str] = field(default_factory=dict)

    def n_prompts(self, c: int) -> int:
        return self.prompts_per_cell or max(2 * c, self.min_prompts)

    def prompts_needed(self) -> int:
        """Every (C, run) its own prompts, plus the warm-up ones (`prompt_plan`)."""
        return WARM_PROMPTS + self.repeats * sum(map(self.n_prompts, self.concurrency))


@dataclass
class Reply:
    tokens: int
    token_ids: list[int]
    ttft: float | None
    e2e: float
    start: float  # perf_counter when the request was sent


# -- the client ---------------------------------------------------------------------------------


async def _one(client, body: dict) -> Reply:
    t0 = time.perf_counter()
    ttft, ids, usage = None, [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise AdaFlashError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            if obj.get("error"):
                raise AdaFlashError(f"server error: {obj['error']}")
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                new = ch.get("token_ids") or []
                if (new or ch.get("text")) and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += new
    tokens = usage["completion_tokens"] if usage else len(ids)
    return Reply(tokens, ids, ttft, time.perf_counter() - t0, t0)


async def _closed_loop(url: str, bodies: list[dict], concurrency: int, timeout: float) -> list[Reply]:
    todo = list(enumerate(bodies))
    out: list[Reply | None] = [None] * len(bodies)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def client_loop() -> None:
            while todo:
                i, body = todo.pop(0)
                out[i] = await _one(client, body)

        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(bodies)))))
    return [r for r in out if r is not None]


def request_body(ids: list[int], max_tokens: int, method: str | None) -> dict:
    """The same body for every engine; `method` (ours only) picks our row's method per request.
    `return_token_ids` and `stream_options` are vLLM's ways to stream ids and usage (ours sends both)."""
    body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    return {**body, "method": method} if method else body


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def http_cell(url: str, prompts: list[list[int]], method: str | None, concurrency: int, max_new: int,
              cpu=None, timeout: float = 1800.0) -> tuple[dict, list[list[int]]]:  # fmt: skip
    """One closed-loop run through HTTP: its stats, and every answer's token ids (prompt order)."""
    bodies = [request_body(p, max_new, method) for p in prompts]
    cpu0 = cpu() if cpu else None
    t0, client0 = time.perf_counter(), time.process_time()
    replies = asyncio.run(_closed_loop(url, bodies, concurrency, timeout))
    wall = time.perf_counter() - t0
    client_cpu = time.process_time() - client0
    tokens = sum(r.tokens for r in replies)
    ttft = [r.ttft for r in replies if r.ttft is not None]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in replies if r.ttft is not None and r.tokens > 1]
    cell = {
        "requests": len(replies),
        "output_tokens": tokens,
        "wall_s": wall,
        "tps": tokens / wall,
        "ttft_s": {"p50": _pct(ttft, 50), "p95": _pct(ttft, 95)},
        "tpot_s": {"p50": _pct(tpot, 50), "p95": _pct(tpot, 95)},
        "e2e_s": {"p50": _pct([r.e2e for r in replies], 50), "p95": _pct([r.e2e for r in replies], 95)},
        # The client's own CPU (it shares the machine with the server) and each request's
        # (sent, ended) seconds from the cell's start: the closed loop, checkable afterwards.
        "client_cpu_s": client_cpu,
        "spans_s": [(r.start - t0, r.start - t0 + r.e2e) for r in replies],
    }
    if cpu is not None:
        cell["server_cpu_s"] = cpu() - cpu0
        cell["tps_server_cpu"] = tokens / max(cell["server_cpu_s"], 1e-9)
    return cell, [r.token_ids for r in replies]


def inproc_cell(engine, prompts: Prompts, method: str, concurrency: int, max_new: int, on_main: bool):
    """The same cell in-process (no HTTP), in the same shape as `http_cell`'s, on the thread where
    our server steps its engine: a worker thread, or the main one with `ADAFLASH_STEP_LOOP=main`
    in `--ours-env` (`serving.launch.STEP_LOOPS` says why the thread matters)."""
    if on_main:
        c, outs = run_cell(engine, prompts, method, concurrency, max_new)
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="inproc-cell") as pool:
            c, outs = pool.submit(run_cell, engine, prompts, method, concurrency, max_new).result()
    keep = ("requests", "output_tokens", "wall_s", "tps", "tau", "cpu_share")
    cell = {k: c[k] for k in keep}
    cell.update({k: {q: c[k][q] for q in ("p50", "p95")} for k in ("ttft_s", "tpot_s", "e2e_s")})
    return cell, outs


# -- the run ------------------------------------------------------------------------------------


class Results:
    """results.json as it grows: runs[engine][method][C] = [cell, ...], outputs of each row's first
    run; written after every block, so a rerun with the same spec resumes."""

    def __init__(self, out: Path, head: dict) -> None:
        self.path = out / "results.json"
        self.data = {**head, "runs": {}, "outputs": {}, "servers": {}}
        if self.path.exists():
            old = json.loads(self.path.read_text())
            if old.get("spec") == head["spec"] and old.get("prompts") == head["prompts"]:
                self.data.update(runs=old["runs"], outputs=old["outputs"], servers=old.get("servers", {}))

    def done(self, engine: str, methods: list[str], c: int) -> bool:
        runs = self.data["runs"].get(engine, {})
        return all(len(runs.get(m, {}).get(str(c), [])) >= self.data["spec"]["repeats"] for m in methods)

    def add(self, engine: str, method: str, c: int, runs: list[tuple[dict, list[list[int]]]]) -> None:
        self.data["runs"].setdefault(engine, {}).setdefault(method, {})[str(c)] = [cell for cell, _ in runs]
        self.data["outputs"].setdefault(f"{engine}/{method}", {})[str(c)] = runs[0][1]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data))
        self.path.with_suffix(".md").write_text(markdown(self.data))  # the table so far


def block(spec: HttpSpec, methods: list[str], run) -> dict[str, list]:
    """`spec.repeats` runs of each method, `run(method, rep)`, the order alternating (forward,
    reversed, ...) so that a drift of the machine's speed favours no method."""
    runs: dict[str, list] = {m: [] for m in methods}
    for rep in range(spec.repeats):
        for m in methods if rep % 2 == 0 else methods[::-1]:
            runs[m].append(run(m, rep))
    return runs


def prompt_plan(spec: HttpSpec, prompts: Prompts) -> tuple[Prompts, dict[int, list[Prompts]]]:
    """Split the prompts into the warm-up ones and `ids[C][rep]`: disjoint slices, one per (C, run)."""
    need = spec.prompts_needed()
    if len(prompts) < need:
        raise InputError(
            f"bench-http needs {need} distinct prompts ({spec.repeats} runs x C = {spec.concurrency}, "
            f"each run its own prompts, + {WARM_PROMPTS} warm-up) but the {spec.domain!r} domain has "
            f"{len(prompts)} within {spec.max_prompt_tokens} tokens: lower --repeats / --concurrency, "
            "or use a bigger domain"
        )
    it = iter(prompts)
    warm = [next(it) for _ in range(WARM_PROMPTS)]
    ids = {c: [[next(it) for _ in range(spec.n_prompts(c))] for _ in range(spec.repeats)]
           for c in spec.concurrency}  # fmt: skip
    return warm, ids


def run_http_bench(target, bundle, drafter: Path | None, spec: HttpSpec, out: Path, log=print) -> dict:
    """Every engine of `spec.engines` through HTTP and our in-process engine, on the same prompts."""
    rows = workload(
        target,
        BenchSpec(
            domains=[spec.domain],
            warm=0,
            data_dir=spec.data_dir and Path(spec.data_dir),
            max_prompt_tokens=spec.max_prompt_tokens,
        ),
        spec.prompts_needed(),
    )
    prompts = rows[spec.domain]
    warm, ids = prompt_plan(spec, [p for _, p in prompts])
    longest = max(len(p) for _, p in prompts)
    head = {"spec": asdict(spec), "target": target.name, "drafter": str(drafter) if drafter else None,
            "block_size": bundle.config.block_size if bundle else None, "machine": machine(),
            "prompts": [pid for pid, _ in prompts]}  # fmt: skip
    res = Results(out, head)
    ours_methods = ["ar", "adaflash-cost"] if bundle is not None else ["ar"]
    inproc_blocks(target, bundle, spec, ids, longest, ours_methods, res, log)
    gc.collect()  # the in-process engine's KV cache and packed weights, before the servers start
    for name in spec.engines:
        plan = server_plan(name, target, bundle, drafter, spec, longest, ours_methods)
        if plan is None:
            why = "vLLM serves the SmolLM2 target only" if target.name != "smollm2" else "needs --drafter"
            log(f"{name}: skipped ({why})")
            res.data.setdefault("skipped", {})[name] = why
            continue
        if all(res.done(name, plan.methods, c) for c in spec.concurrency):
            continue
        try:
            serve_block(plan, spec, warm, ids, res, out, log)
        except (AdaFlashError, httpx.HTTPError) as e:  # a server that fails: the others still run
            log(f"{name}: FAILED: {e}")
            res.data.setdefault("skipped", {})[name] = f"failed: {str(e).splitlines()[0]}"
            res.save()
    return res.data


def inproc_blocks(target, bundle, spec: HttpSpec, ids: dict, longest: int, methods: list[str],
                  res: Results, log) -> None:  # fmt: skip
    """Our engine in-process on the same prompts: the reference every served row is divided by."""
    todo = [c for c in spec.concurrency if not res.done(INPROC, methods, c)]
    if not todo:
        return
    sized = BenchSpec(methods=methods, concurrency=spec.concurrency, max_new_tokens=spec.max_new_tokens)
    engine = bench_engine(target, bundle, sized, longest)
    for c in todo:
        timed = lambda m, rep, c=c: inproc_cell(  # noqa: E731
            engine, ids[c][rep], m, c, spec.max_new_tokens, spec.ours_env.get("ADAFLASH_STEP_LOOP") == "main"
        )
        runs = block(spec, methods, timed)
        for m in methods:
            res.add(INPROC, m, c, runs[m])
            log(_line(INPROC, m, c, runs[m]))
        res.save()


def server_plan(name: str, target, bundle, drafter: Path | None, spec: HttpSpec, longest: int,
                ours_methods: list[str]) -> hs.ServerPlan | None:  # fmt: skip
    """What to start for engine `name`; None where it cannot run (vLLM without the SmolLM2
    folder, DFlash without a drafter)."""
    max_len = longest + spec.max_new_tokens + 1
    if name == "ours":
        budget = max(spec.concurrency) * (bundle.config.block_size if bundle else 1)
        argv = hs.ours_argv(spec.target, drafter, max(spec.concurrency), max_len, budget)
        return hs.ServerPlan(name, argv, ours_methods, env=dict(spec.ours_env), ready_timeout=300)
    if target.name != "smollm2":
        return None  # vLLM serves the dequantised SmolLM2 folder; the tiny target has none
    from adaflash.models.targets import smollm2_dir

    export = None
    if name == "vllm-dflash":
        if drafter is None:
            return None
        export = vllm_export(drafter, target, Path(spec.work) / "vllm-drafter")
    k = bundle.config.block_size if bundle else 8
    return hs.ServerPlan(name, hs.vllm_argv(name, smollm2_dir(), export, k, max(2048, max_len)), ["ar"])


def vllm_export(drafter: Path, target, dest: Path) -> Path:
    from adaflash.models.targets import smollm2_dir
    from adaflash.serving.export import export_drafter

    if not (dest / "config.json").exists():
        export_drafter(drafter, dest, target_fingerprint=target.fingerprint, fmt="vllm",
                       target_dir=smollm2_dir())  # fmt: skip
    return dest


def serve_block(plan: hs.ServerPlan, spec: HttpSpec, warm: Prompts, ids: dict, res: Results, out: Path,
                log) -> None:  # fmt: skip
    """Start `plan`'s server once, warm it, run every C block it still lacks, stop it."""
    log_path = Path(spec.work) / "logs" / f"{plan.engine}.log"
    log(f"{plan.engine}: starting (log: {log_path})")
    with hs.Server(plan, free_port(), log_path, spec.nice) as srv:
        log(f"{plan.engine}: ready in {srv.ready_s:.0f} s")
        res.data["servers"][plan.engine] = {"ready_s": srv.ready_s, "argv": srv.argv}
        methods = plan.methods if plan.engine == "ours" else [None]
        http_cell(srv.url, warm, methods[0], 2, min(8, spec.max_new_tokens))  # first-call costs: untimed
        for c in spec.concurrency:
            if res.done(plan.engine, plan.methods, c):
                continue
            timed = lambda m, rep, c=c: http_cell(  # noqa: E731
                srv.url, ids[c][rep], m, c, spec.max_new_tokens, srv.cpu_seconds
            )
            runs = block(spec, methods, timed)
            for m in methods:
                res.add(plan.engine, m or "ar", c, runs[m])
                log(_line(plan.engine, m or "ar", c, runs[m]))
            res.save()
        if spec.profile and plan.engine == "ours":
            profile_ours(srv, spec, ids, out, log)


def profile_ours(srv: hs.Server, spec: HttpSpec, ids: dict, out: Path, log) -> None:
    """One extra AR run at C = 1 and C = 8 with py-spy attached (not timed: sampling costs time)."""
    profiles = {}
    for c in [c for c in (1, 8) if c in ids]:
        raw = out / f"profile-ar-c{c}.txt"
        with hs.PySpy(srv.pid, raw, rate=PROFILE_RATE):
            cell, _ = http_cell(srv.url, ids[c][0], "ar", c, spec.max_new_tokens)  # our server: no cache
        profiles[f"served AR, C = {c}"] = hs.summarise_profile(raw, wall_s=cell["wall_s"], rate=PROFILE_RATE)
    log(f"profile: {hs.write_profile(out, profiles)}")


def _line(engine: str, method: str, c: int, runs: list) -> str:
    tps = [cell["tps"] for cell, _ in runs]
    each = "/".join(f"{t:.1f}" for t in tps)
    return f"{engine:12s} {method:14s} C={c:<3d} {max(tps):8.2f} tok/s (runs {each})"
