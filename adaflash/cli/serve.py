"""`adaflash generate`, `serve`, `gateway`, `fleet run` and `sglang launch-args`: decode, serve,
and put a fleet in front of the feedback loop. The processes themselves are wired in
`adaflash.serving.launch`; these commands parse options and load the target."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from adaflash.cli._common import BootstrapOpt, LockstepOpt, TargetOpt, console, err_console, load
from adaflash.errors import InputError
from adaflash.serving.config import LOCKSTEP_MIN_PROB

app = typer.Typer()
sglang_app = typer.Typer(no_args_is_help=True, help="Serve exported drafters with SGLang (GPU fleet).")
fleet_app = typer.Typer(no_args_is_help=True, help="The fleet controller: make the champion live everywhere.")
app.add_typer(sglang_app, name="sglang")
app.add_typer(fleet_app, name="fleet")

SpoolOpt = Annotated[Path, typer.Option(help="feedback spool while Kafka is unreachable")]


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="user message (chat template applied)")],
    target: TargetOpt = "smollm2",
    drafter: Annotated[Path | None, typer.Option(help="drafter directory (DFlash format)")] = None,
    method: Annotated[str, typer.Option(help="ar | dflash | adaflash | adaflash-cost | ngram")] = "adaflash",
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    max_new_tokens: Annotated[int, typer.Option()] = 128,
    gamma: Annotated[float, typer.Option(help="scales the verify length k̂ = ⌊γ·â·k⌋")] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Generate one completion on the serving engine and print it with its stats."""
    from adaflash.serving.offline import DecodeConfig, OfflineDecoder

    if method != "ar" and drafter is None:
        raise InputError(f"method {method!r} needs --drafter DIR")
    tgt, bundle = load(target, drafter)
    ids = tgt.tokenizer.chat_prompt(prompt)
    cfg = DecodeConfig(method, max_new_tokens, temperature, gamma, seed)
    res = OfflineDecoder(tgt, bundle).generate([ids], cfg)[0]
    text = tgt.tokenizer.decode(res.token_ids)
    stats = {
        "method": method,
        "tau": round(res.tau, 4),
        "mean_verify_len": round(res.mean_verify_len, 3),
        "rounds": len(res.rounds),
        "new_tokens": len(res.token_ids),
        "tokens_per_second": round(len(res.token_ids) / res.seconds, 2),
        "finish_reason": res.finish_reason,
    }
    if as_json:
        print(json.dumps({"text": text, "token_ids": res.token_ids, **stats}))
        return
    console.print(text, markup=False, highlight=False)
    console.print(" ".join(f"[bold]{k}[/]={v}" for k, v in stats.items()), style="dim")


SuffixCacheOpt = Annotated[
    bool, typer.Option(help="learn from governed responses (adaflash.feedback.clean) for suffix drafts")
]
SuffixCrossOpt = Annotated[
    bool, typer.Option(help="also one suffix index over all tenants (leaks timing across tenants)")
]
PrefixCacheOpt = Annotated[
    bool, typer.Option(help="reuse the K/V of a tenant's earlier prompt heads (memory only; lossless)")
]
PrefixCrossOpt = Annotated[
    bool, typer.Option(help="one prefix cache over all tenants (leaks timing across tenants)")
]
STEP_LOOP_HELP = (
    "where the engine steps: thread (robust when other jobs share the cores) | main (faster on "
    "dedicated cores, slower beside a busy job; docs/deploy.md)"
)


@app.command()
def serve(
    target: TargetOpt = "smollm2",
    drafter: Annotated[
        Path | None, typer.Option(help="drafter directory (DFlash format); none = ar only")
    ] = None,
    port: Annotated[int, typer.Option()] = 8000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    method: Annotated[
        str, typer.Option(help="default method: ar | dflash | adaflash | adaflash-cost | ngram | suffix")
    ] = "adaflash",
    gamma: Annotated[float, typer.Option(help="k̂ = ⌊γ·â·k⌋")] = 1.0,
    max_running: Annotated[int, typer.Option(help="KV slots (requests decoding at once)")] = 32,
    max_queue: Annotated[int, typer.Option(help="waiting requests before HTTP 429")] = 64,
    max_model_len: Annotated[int, typer.Option(help="per-request prompt + max_tokens")] = 2048,
    step_token_budget: Annotated[int, typer.Option(help="verify tokens one step may pack")] = 1024,
    beta: Annotated[float, typer.Option(help="EMA weight of admission's N̂")] = 0.5,
    probe_every: Annotated[int, typer.Option(help="after k̂=1, skip the drafter for N-1 rounds")] = 1,
    lockstep_min_prob: LockstepOpt = LOCKSTEP_MIN_PROB,
    bootstrap_servers: Annotated[
        str | None, typer.Option("--bootstrap-servers", help="Kafka for feedback records (none: no feedback)")
    ] = None,
    spool_dir: SpoolOpt = Path(".adaflash/spool"),
    model_name: Annotated[str, typer.Option(help="model id reported by the API")] = "adaflash",
    follow_registry: Annotated[
        str | None,
        typer.Option(
            help="MLflow URL: serve its champion and hot-reload on promotions/rollbacks (needs Kafka)"
        ),
    ] = None,
    suffix_cache: SuffixCacheOpt = True,
    suffix_cross_tenant: SuffixCrossOpt = False,
    suffix_max_tokens: Annotated[int, typer.Option(help="suffix cache cap, all tenants")] = 1_000_000,
    suffix_max_tokens_per_tenant: Annotated[int, typer.Option(help="suffix cache cap per tenant")] = 200_000,
    prefix_cache: PrefixCacheOpt = True,
    prefix_cache_mb: Annotated[float, typer.Option(help="prefix cache cap in MB, all tenants")] = 1024,
    prefix_cross_tenant: PrefixCrossOpt = False,
    step_loop: Annotated[str, typer.Option(envvar="ADAFLASH_STEP_LOOP", help=STEP_LOOP_HELP)] = "thread",
) -> None:
    """OpenAI-compatible server: /v1/completions, /v1/chat/completions, /health, /metrics, admin reload.

    The admin API (POST /admin/drafter/reload) takes `Authorization: Bearer $ADAFLASH_ADMIN_TOKEN`;
    without that variable it is disabled.
    """
    from adaflash.serving import launch
    from adaflash.serving.engine import EngineConfig
    from adaflash.serving.prefix_cache import PrefixCacheConfig
    from adaflash.serving.suffix_cache import SuffixCacheConfig

    launch.check_step_loop(step_loop)  # before the target loads: a typo fails in a second
    tgt, bundle = load(target, drafter)
    if bundle is None and method not in ("ar", "ngram", "suffix"):
        raise InputError(f"method {method!r} needs --drafter DIR (or use --method ar | ngram | suffix)")
    cfg = EngineConfig(
        method=method,
        gamma=gamma,
        max_running=max_running,
        max_queue=max_queue,
        max_model_len=max_model_len,
        step_token_budget=step_token_budget,
        beta=beta,
        probe_every=probe_every,
        lockstep_min_prob=lockstep_min_prob,
        suffix=SuffixCacheConfig(
            enabled=suffix_cache,
            cross_tenant=suffix_cross_tenant,
            max_tokens=suffix_max_tokens,
            max_tokens_per_tenant=suffix_max_tokens_per_tenant,
        ),
        prefix=PrefixCacheConfig(prefix_cache, max_mb=prefix_cache_mb, cross_tenant=prefix_cross_tenant),
    )
    token = os.environ.get("ADAFLASH_ADMIN_TOKEN") or None
    opts = launch.ServeOptions(
        host, port, model_name, bootstrap_servers, spool_dir, follow_registry, token, step_loop
    )
    launch.serve(tgt, bundle, drafter, cfg, opts, log=err_console.print)


@app.command()
def gateway(
    upstream: Annotated[str, typer.Option(help="OpenAI-compatible backend (SGLang, vLLM, adaflash serve)")],
    api_keys: Annotated[Path, typer.Option(help="JSON file {api_key: tenant_id}")],
    target: TargetOpt = "smollm2",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8080,
    bootstrap_servers: BootstrapOpt = "127.0.0.1:9092",
    spool_dir: SpoolOpt = Path(".adaflash/gateway-spool"),
    drafter_version: Annotated[
        str | None, typer.Option(help="what the fleet serves, if it does not say")
    ] = None,
    method: Annotated[
        str, typer.Option(help="what the fleet runs: dflash (SGLang) | adaflash | ar")
    ] = "dflash",
    block_size: Annotated[int, typer.Option(help="the fleet's drafter block size")] = 16,
) -> None:
    """Feedback gateway: proxy an OpenAI-compatible fleet unchanged and emit one record per request."""
    from adaflash.serving import launch
    from adaflash.serving.gateway import GatewaySettings

    keys = launch.read_api_keys(api_keys)
    settings = GatewaySettings(upstream, keys, drafter_version, method, block_size)
    launch.gateway(settings, target, bootstrap_servers, spool_dir, host, port, log=err_console.print)


@fleet_app.command("run")
def fleet_run(
    config: Annotated[Path, typer.Option(help="fleet YAML (see manifests/base/fleet-controller.yaml)")],
    health_port: Annotated[int, typer.Option(help="GET /healthz for probes")] = 8081,
    engine: Annotated[
        str | None,
        typer.Option(help="also run this engine here: vllm (from .venv-vllm, `make vllm`) on --engine-port"),
    ] = None,
    engine_port: Annotated[
        int, typer.Option(help="the local engine's stable port (the gateway's upstream)")
    ] = 8000,
    engine_method: Annotated[
        str, typer.Option(help="vllm: dflash (the champion) | ngram | suffix | ar")
    ] = "dflash",
) -> None:
    """Follow adaflash.drafter.events; reload engines / roll SGLang / roll vLLM on every champion change."""
    from adaflash.serving.fleet import Backend
    from adaflash.serving.launch import fleet_controller

    if engine not in (None, "vllm"):  # SGLang runs as a Deployment: a sglang-deployment backend in --config
        raise InputError(f"--engine {engine!r}: only vllm runs as a local process")
    extra = (Backend("vllm-process", port=engine_port, method=engine_method),) if engine == "vllm" else ()
    fleet_controller(config, health_port, log=err_console.print, extra=extra)


@sglang_app.command("launch-args")
def sglang_launch_args(
    drafter: Annotated[Path, typer.Option(help="exported drafter directory (read for its block size)")],
    target: TargetOpt = "smollm2",
    model_path: Annotated[
        str | None, typer.Option(help="target checkpoint as the server sees it (default: --target's dir)")
    ] = None,
    drafter_path: Annotated[
        str | None, typer.Option(help="drafter path as the server sees it (default: --drafter)")
    ] = None,
    host: Annotated[str, typer.Option()] = "0.0.0.0",
    port: Annotated[int, typer.Option()] = 30000,
    dtype: Annotated[str | None, typer.Option(help="SGLang --dtype (default: SGLang's)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the argv as a JSON list")] = False,
) -> None:
    """Print the `python -m sglang.launch_server ... --speculative-algorithm DFLASH` line for a drafter."""
    from adaflash.errors import CheckpointError
    from adaflash.models.targets import load_vocabulary
    from adaflash.serving.export import drafter_block_size, sglang_launch_argv, shell_line, target_model_path

    k = drafter_block_size(drafter)
    meta_file = drafter / "adaflash.json"
    if meta_file.exists():  # a drafter only fits the exact target it was trained for
        trained_for = json.loads(meta_file.read_text()).get("target_fingerprint")
        fp = load_vocabulary(target).fingerprint
        if trained_for != fp:
            raise CheckpointError(
                f"drafter {drafter} was trained for target {trained_for}, not {target} ({fp})"
            )
    argv = sglang_launch_argv(model_path or target_model_path(target), drafter_path or str(drafter), k,
                              host=host, port=port, dtype=dtype)  # fmt: skip
    print(json.dumps(argv) if as_json else shell_line(argv))
