"""`adaflash` command line. Expected failures (`AdaFlashError`) print one line and exit 2."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from adaflash.errors import AdaFlashError, InputError

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
drafter_app = typer.Typer(no_args_is_help=True, help="Create and inspect drafters.")
app.add_typer(drafter_app, name="drafter")
console = Console()
err_console = Console(stderr=True)

TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="smollm2 | tiny | path to an HF Llama/Qwen3 checkpoint")
]


def _setup_torch() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("ADAFLASH_THREADS", os.cpu_count() or 2)))


def _load(target: str, drafter: Path | None):
    from adaflash.models.checkpoint import load_drafter_for
    from adaflash.models.targets import load_target

    _setup_torch()
    tgt = load_target(target)
    bundle = load_drafter_for(drafter, tgt) if drafter is not None else None
    return tgt, bundle


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="user message (chat template applied)")],
    target: TargetOpt = "smollm2",
    drafter: Annotated[Path | None, typer.Option(help="drafter directory (DFlash format)")] = None,
    method: Annotated[str, typer.Option(help="ar | dflash | adaflash")] = "adaflash",
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    max_new_tokens: Annotated[int, typer.Option()] = 128,
    gamma: Annotated[float, typer.Option(help="scales the verify length k̂ = ⌊γ·â·k⌋")] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Generate a completion with speculative decoding and print it with its stats."""
    from adaflash.serving.speculative import DecodeConfig, SpeculativeDecoder

    if method != "ar" and drafter is None:
        raise InputError(f"method {method!r} needs --drafter DIR")
    tgt, bundle = _load(target, drafter)
    ids = tgt.tokenizer.chat_prompt(prompt)
    cfg = DecodeConfig(method, max_new_tokens, temperature, gamma, seed)
    res = SpeculativeDecoder(tgt, bundle).generate([ids], cfg)[0]
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


@drafter_app.command("bootstrap")
def bootstrap(
    out: Annotated[Path, typer.Option(help="drafter directory to write (resumed if it exists)")],
    target: TargetOpt = "smollm2",
    steps: Annotated[int, typer.Option(help="optimiser steps (the run's length; not a time budget)")] = 2200,
    budget_minutes: Annotated[
        float | None, typer.Option(help="optional cap on the whole run, generation included")
    ] = None,
    block_size: Annotated[int, typer.Option()] = 8,
    layers: Annotated[int, typer.Option(help="drafter layers")] = 2,
    lr: Annotated[float, typer.Option(help="peak drafter learning rate (warm-up + cosine)")] = 3e-3,
    anchors: Annotated[int, typer.Option(help="anchor blocks per sequence per step")] = 16,
    seqs_per_step: Annotated[int, typer.Option(help="sequences per optimiser step")] = 8,
    kl_weight: Annotated[float, typer.Option(help="> 0: CE + top-k forward KL (teacher top-32)")] = 0.0,
    position_decay: Annotated[float, typer.Option(help="weight exp(-(i-1)/γ) of draft position i")] = 4.0,
    bf16: Annotated[bool, typer.Option(help="bf16 autocast for training steps")] = False,
    init_from_target: Annotated[bool, typer.Option(help="start from the target's top layers")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="response length cap of the training data")] = 256,
    max_train_prompts: Annotated[int | None, typer.Option(help="use only the first N train prompts")] = None,
    generate: Annotated[bool, typer.Option(help="generate responses the committed corpus lacks")] = True,
    refresh_every: Annotated[
        int, typer.Option(help="every N steps, train also on responses newly in the cache (0: off)")
    ] = 0,
    eval_per_domain: Annotated[int, typer.Option(help="held-out prompts per domain for τ")] = 40,
    data_dir: Annotated[Path | None, typer.Option(help="prompt sets (default ../shared/data)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Train the offline "DFlash" drafter + length head on the target's own greedy responses.

    Responses come from the committed corpus (data/responses/) and the cache; missing ones are
    generated. Features are stored once; steps never run the target. Resumable: rerun the same
    command to continue."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from adaflash.training.bootstrap import BootstrapConfig, BootstrapTrainer

    if steps < 0:
        raise InputError("--steps must be >= 0")
    if budget_minutes is not None and budget_minutes <= 0:
        raise InputError("--budget-minutes must be > 0")
    tgt, _ = _load(target, None)
    cfg = BootstrapConfig(
        steps=steps,
        budget_minutes=budget_minutes,
        block_size=block_size,
        num_layers=layers,
        lr=lr,
        anchors_per_seq=anchors,
        seqs_per_step=seqs_per_step,
        kl_weight=kl_weight,
        position_decay=position_decay,
        teacher_topk=32 if kl_weight > 0 else 0,
        bf16=bf16,
        init_from_target=init_from_target,
        max_new_tokens=max_new_tokens,
        max_train_prompts=max_train_prompts,
        generate_missing=generate,
        refresh_every_steps=refresh_every,
        eval_per_domain=eval_per_domain,
        seed=seed,
    )
    import time

    t0 = time.time()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
    ) as progress:
        tasks: dict[str, int] = {}

        def bar(name: str, total: float | None) -> int:
            if name not in tasks:
                tasks[name] = progress.add_task(name, total=total, info="")
            return tasks[name]

        def on(kind: str, info: dict) -> None:
            text = ""
            if kind == "corpus":
                text = f"{info['split']}: {info['responses']} responses from the committed corpus"
            elif kind == "generate":
                tid = bar(f"generate {info['split']}", None)
                progress.update(tid, advance=info["prompts"], info=f"{info['tokens']} tokens")
                text = f"{info['split']} +{info['prompts']} prompts, {info['tokens']} tokens"
            elif kind == "features_start":
                gb = info["bytes"] / 1e9
                text = f"{info['split']}: {info['sequences']} sequences to store (~{gb:.2f} GB)"
                bar(f"features {info['split']}", info["sequences"])
            elif kind == "features":
                progress.update(bar(f"features {info['split']}", None), advance=info["sequences"])
            elif kind == "train_start":
                text = f"{info['sequences']} sequences, {info['tokens']} tokens, vocab {info['vocab']}"
                progress.update(bar("train", info["steps"]), completed=0)
            elif kind == "step":
                progress.update(
                    bar("train", info["steps"]),
                    completed=info["step"],
                    info=f"loss {info['loss']:.3f} acc1 {info['acc1']:.2f} lr {info['lr']:.1e}",
                )
                if info["step"] % 50 == 0:
                    text = f"step {info['step']} loss {info['loss']:.3f} acc1 {info['acc1']:.2f}"
            elif kind == "head":
                progress.update(bar("length head", info["head_steps"]), completed=info["head_step"],
                                info=f"mse {info['mse']:.4f}")  # fmt: skip
            elif kind == "evaluate":
                text = f"evaluating on {info['sequences']} held-out sequences"
            elif kind == "refresh":
                text = f"data grew to {info['sequences']} sequences, {info['tokens']} tokens"
            elif kind == "resume":
                text = f"resuming at step {info['step']} (head step {info['head_step']})"
            elif kind == "curve":
                text = f"held-out τ {info['dflash_tau']:.3f}, acc@1 {info['accept_1']:.3f} @ {info['step']}"
            if text:
                if err_console.is_terminal:
                    progress.console.print(f"  {text}")
                else:  # piped (CI, nohup): rich draws nothing live, so log plain lines
                    print(f"[{(time.time() - t0) / 60:6.1f} min] {text}", file=sys.stderr, flush=True)

        command = "adaflash " + " ".join(sys.argv[1:])
        metrics = BootstrapTrainer(tgt, out, cfg, data_dir, on).run(command)
    _print_bootstrap(metrics, out)


def _print_bootstrap(metrics: dict, out: Path) -> None:
    t = Table(title=f"held-out acceptance — {out}")
    for col in ("domain", "n", "τ dflash", "τ n-gram", "acc@1", "τ adaflash", "mean k̂", "|â−a*|"):
        t.add_column(col, justify="right")
    for dom, row in metrics["heldout"].items():
        t.add_row(
            dom,
            str(row["n_sequences"]),
            f"{row['dflash_tau']:.3f}",
            f"{row.get('ngram_tau', float('nan')):.3f}",
            f"{row['accept_rate_by_position'][0]:.3f}",
            f"{row.get('adaflash_tau', float('nan')):.3f}",
            f"{row.get('adaflash_mean_verify_len', float('nan')):.2f}",
            f"{row.get('length_head_mae', float('nan')):.3f}",
        )
    console.print(t)
    console.print(
        f"trained {metrics['steps']} steps ({metrics['train_minutes']} min) on "
        f"{metrics['train_sequences']} sequences "
        f"({metrics['train_tokens']} tokens); metrics in {out / 'bootstrap_metrics.json'}"
    )


@drafter_app.command("corpus")
def drafter_corpus(
    target: TargetOpt = "smollm2",
    max_new_tokens: Annotated[int, typer.Option(help="response length cap of the cached set")] = 256,
) -> None:
    """Write the cached greedy responses (ids only, no prompt text) to data/responses/ for git."""
    from adaflash.models.targets import load_target
    from adaflash.training.corpus import corpus_path, export_corpus
    from adaflash.training.responses import read_responses, responses_path

    tgt = load_target(target)
    for split in ("train", "heldout"):
        rows = read_responses(responses_path(tgt, split, max_new_tokens))
        if not rows:
            continue
        out = corpus_path(tgt, split, max_new_tokens)
        n = export_corpus(rows, out)
        tokens = sum(len(r.response_ids) for r in rows)
        console.print(f"{split}: {n} responses, {tokens} tokens -> {out} ({out.stat().st_size / 1e6:.2f} MB)")


@drafter_app.command("release")
def drafter_release(
    src: Annotated[Path, typer.Argument(help="a bootstrap output directory")],
    out: Annotated[Path, typer.Option(help="shipped drafter directory")] = Path("drafters/smollm2"),
    target: TargetOpt = "smollm2",
) -> None:
    """Copy a bootstrapped drafter into the repo's shipped form: fp16 weights, head, model card."""
    from adaflash.training.bootstrap import release

    tgt, _ = _load(target, None)
    path = release(src, out, tgt)
    size = sum(f.stat().st_size for f in path.iterdir())
    console.print(f"released {src} -> {path} ({size / 1e6:.1f} MB)")


@drafter_app.command("info")
def drafter_info(path: Annotated[Path, typer.Argument(help="drafter directory")]) -> None:
    """Show a drafter's config and metadata."""
    from adaflash.models.checkpoint import load_drafter

    b = load_drafter(path)
    c = b.config
    console.print_json(
        json.dumps(
            {
                "path": str(path),
                "block_size": c.block_size,
                "layers": c.num_layers,
                "target_layer_ids": list(c.target_layer_ids),
                "mask_token_id": c.mask_token_id,
                "length_head": b.length_head is not None,
                **b.meta.__dict__,
            }
        )
    )


@app.command()
def demo(
    target: TargetOpt = "smollm2",
    drafter: Annotated[
        Path | None,
        typer.Option(help="drafter dir (default: the shipped drafters/smollm2; tiny: a quick one)"),
    ] = None,
    requests: Annotated[int, typer.Option(help="chat requests of demo traffic")] = 48,
    max_tokens: Annotated[int, typer.Option(help="tokens per answer")] = 64,
    epochs: Annotated[int, typer.Option(help="pipeline training epochs")] = 2,
    home: Annotated[Path, typer.Option(help="the demo's own stack state (wiped first)")] = Path(
        ".adaflash/demo"
    ),
) -> None:
    """The whole loop once: traffic → governance → pipeline → promotion → reload → lineage → rollback.

    Serves the drafter that ships in git; it never trains one on the fly (a loaded machine would
    only make that slower, never different)."""
    from adaflash.scenario import Scenario, ScenarioConfig

    _setup_torch()
    if drafter is None:
        if target != "smollm2":
            raise InputError("--drafter DIR is required for targets other than smollm2")
        drafter = Path("drafters/smollm2")
    if not (drafter / "config.json").exists():
        raise InputError(
            f"no drafter at {drafter}: a checkout ships drafters/smollm2 (git status shows whether it "
            "was deleted); `make bootstrap` rebuilds it"
        )
    cfg = ScenarioConfig(
        target=target, drafter=drafter, home=home, requests=requests, max_tokens=max_tokens, epochs=epochs
    )
    Scenario(cfg, console).run()


@app.command()
def compare(
    target: TargetOpt = "smollm2",
    drafter: Annotated[Path, typer.Option(help="drafter dir")] = Path("drafters/smollm2"),
    prompts_per_domain: Annotated[int, typer.Option()] = 3,
    max_new_tokens: Annotated[int, typer.Option()] = 96,
) -> None:
    """Compare ar / dflash / adaflash on held-out prompts with one drafter, batch 1, greedy."""
    from adaflash.compare import run_comparison

    tgt, bundle = _load(target, drafter)
    run_comparison(tgt, bundle, prompts_per_domain, max_new_tokens, console)


# -- feedback bus, governance, lineage ---------------------------------------------------------------
broker_app = typer.Typer(no_args_is_help=True, help="The embedded Kafka broker (Tansu) on loopback.")
governance_app = typer.Typer(
    no_args_is_help=True, help="Scrub, validate and filter feedback into the buffer."
)
lineage_app = typer.Typer(no_args_is_help=True, help="Where records went, why, and what they trained.")
app.add_typer(broker_app, name="broker")
app.add_typer(governance_app, name="governance")
app.add_typer(lineage_app, name="lineage")


def _home() -> Path:
    """Runtime state (broker pid/log, governance buffer + lineage): $ADAFLASH_HOME or ./.adaflash."""
    return Path(os.environ.get("ADAFLASH_HOME", ".adaflash"))


BootstrapOpt = Annotated[
    str, typer.Option("--bootstrap-servers", help="Kafka bootstrap servers (host:port[,host:port])")
]
GovDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", help="governance state: buffer + lineage (default $ADAFLASH_HOME/governance)"),
]


def _broker(port: int | None):
    """The broker of $ADAFLASH_HOME; without --port, on the port it was started on (its pid file)."""
    from adaflash.feedback.broker import Broker

    state = _home() / "broker"
    if port is None:
        try:
            port = int(json.loads((state / "broker.json").read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError):
            port = 9092
    return Broker(state, port=port)


BrokerPortQuery = Annotated[
    int | None, typer.Option("--port", help="default: the port `broker start` used, else 9092")
]


@broker_app.command("start")
def broker_start(port: Annotated[int, typer.Option(help="loopback port")] = 9092) -> None:
    """Start Tansu (if not running) and create the AdaFlash topics."""
    st = _broker(port).start()
    console.print(f"broker running: pid {st['pid']} on {st['bootstrap_servers']} (log {st['log']})")
    console.print("[dim]topics live in memory: a broker restart loses them (production runs Kafka)[/]")


@broker_app.command("stop")
def broker_stop(port: BrokerPortQuery = None) -> None:
    """Stop the broker started by `adaflash broker start`."""
    console.print("broker stopped" if _broker(port).stop() else "no broker was running")


@broker_app.command("status")
def broker_status(port: BrokerPortQuery = None) -> None:
    """Show whether the broker is up, and its topics."""
    st = _broker(port).status()
    if st["running"]:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=st["bootstrap_servers"])
        st["topics"] = sorted(admin.list_topics())
        admin.close()
    console.print_json(json.dumps(st))
    if not st["running"]:
        raise typer.Exit(1)


def _governor(target: str, data_dir: Path | None, bootstrap_servers: str, batch_size: int):
    from adaflash.governance.service import GovernanceConfig, Governor
    from adaflash.models.targets import load_vocabulary

    cfg = GovernanceConfig(
        data_dir=data_dir or _home() / "governance",
        bootstrap_servers=bootstrap_servers,
        batch_size=batch_size,
    )
    with err_console.status("loading tokenizer, Presidio + spaCy and the GX suite..."):
        return cfg, Governor(cfg, load_vocabulary(target))


@governance_app.command("run")
def governance_run(
    target: TargetOpt = "smollm2",
    bootstrap_servers: BootstrapOpt = "127.0.0.1:9092",
    data_dir: GovDirOpt = None,
    batch_size: Annotated[int, typer.Option(help="records per batch (one audit entry each)")] = 256,
    max_batches: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
    idle_exit: Annotated[float | None, typer.Option(help="stop after this many idle seconds")] = None,
) -> None:
    """Consume adaflash.feedback.raw; write clean shards, the clean/quarantine topics and the audit."""
    from adaflash.governance.service import GovernanceService

    cfg, gov = _governor(target, data_dir, bootstrap_servers, batch_size)
    svc = GovernanceService(cfg, gov)

    def show(a) -> None:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(a.reasons.items())) or "-"
        print(
            f"batch {a.batch_id[:8]}: in={a.n_in} clean={a.n_clean} quarantined={a.n_quarantined} "
            f"duplicate={a.n_duplicate} reasons: {reasons} ({a.seconds:.1f}s)",
            flush=True,
        )

    try:
        n = svc.run(max_batches=max_batches, idle_exit_s=idle_exit, on_batch=show)
    finally:
        svc.close()
    console.print(f"governed {n} batches into {cfg.data_dir}")


@governance_app.command("bench")
def governance_bench(
    target: TargetOpt = "smollm2",
    records: Annotated[int, typer.Option(help="synthetic records (~300 tokens of prompt+output each)")] = 600,
    batch_size: Annotated[int, typer.Option()] = 200,
    out: Annotated[Path, typer.Option(help="writes governance_bench.json/.md/.png here")] = Path(
        "benchmarks/governance"
    ),
    data_dir: Annotated[Path | None, typer.Option(help="prompt sets (default ../shared/data)")] = None,
    workers: Annotated[int, typer.Option(help="also measure N governance processes side by side")] = 2,
    pii: Annotated[
        str, typer.Option(help="PII layers: both (default) | presidio (context boost) | legacy (issue 4)")
    ] = "both",
    quality: Annotated[bool, typer.Option(help="also measure false positives on the PII-free sets")] = True,
) -> None:
    """Measure governance records/s on this machine and where the time goes (vs raw spaCy)."""
    from adaflash.governance.bench import run_bench

    run_bench(target, records, batch_size, out, data_dir, console, workers, pii=pii, quality=quality)


def _lineage(data_dir: Path | None):
    from adaflash.governance.lineage import LineageStore

    path = (data_dir or _home() / "governance") / "lineage.sqlite"
    if not path.exists():
        raise InputError(
            f"no lineage store at {path}: run `adaflash governance run` first or pass --data-dir"
        )
    return LineageStore(path)


@lineage_app.command("record")
def lineage_record(record_id: str, data_dir: GovDirOpt = None) -> None:
    """Clean or quarantined (and why), which shard, which drafter versions trained on it."""
    row = _lineage(data_dir).record(record_id)
    if row is None:
        raise InputError(f"record {record_id} is not in the lineage store")
    console.print_json(json.dumps(row))


@lineage_app.command("shard")
def lineage_shard(shard_id: str, data_dir: GovDirOpt = None) -> None:
    """A buffer shard: tenant, date, record count, the batch that wrote it, versions it trained."""
    row = _lineage(data_dir).shard(shard_id)
    if row is None:
        raise InputError(f"shard {shard_id} is not in the lineage store")
    console.print_json(json.dumps(row))


@lineage_app.command("tenant")
def lineage_tenant(tenant_id: str, data_dir: GovDirOpt = None) -> None:
    """A tenant's clean/quarantined counts and quarantine reasons."""
    console.print_json(json.dumps(_lineage(data_dir).tenant(tenant_id)))


@lineage_app.command("audit")
def lineage_audit(
    data_dir: GovDirOpt = None, last: Annotated[int, typer.Option(help="most recent batches")] = 10
) -> None:
    """The governance audit log: per batch offsets, in/clean/quarantined/duplicate, reasons, PII types."""
    store = _lineage(data_dir)
    t = Table(title=f"governance audit — totals {store.totals()}")
    for col in ("batch", "finished", "offsets", "in", "clean", "quar.", "dup.", "reasons", "PII scrubbed"):
        t.add_column(col)
    for a in store.audit(last):
        offs = ", ".join(f"{k.rsplit('.', 1)[-1]}:{v[0]}-{v[1]}" for k, v in sorted(a["offsets"].items()))
        t.add_row(
            a["batch_id"][:8],
            a["finished_at"][:19],
            offs,
            str(a["n_in"]),
            str(a["n_clean"]),
            str(a["n_quarantined"]),
            str(a["n_duplicate"]),
            ", ".join(f"{k}={v}" for k, v in sorted(a["reasons"].items())),
            ", ".join(f"{k}={v}" for k, v in sorted(a["pii_entities"].items())),
        )
    console.print(t)


# -- registry (MLflow) -------------------------------------------------------------------------------
registry_app = typer.Typer(
    no_args_is_help=True, help="Drafter versions in MLflow: list, approve, promote, roll back."
)
registry_server_app = typer.Typer(
    no_args_is_help=True, help="The embedded MLflow server (SQLite store, local artifacts) on loopback."
)
registry_app.add_typer(registry_server_app, name="server")
app.add_typer(registry_app, name="registry")

TrackingOpt = Annotated[
    str, typer.Option("--tracking-uri", envvar="MLFLOW_TRACKING_URI", help="MLflow tracking/registry server")
]
EventsBootstrapOpt = Annotated[
    str,
    typer.Option(
        "--bootstrap-servers",
        help="Kafka for adaflash.drafter.events ('' or unreachable: the action still happens, unpublished)",
    ),
]
WhoOpt = Annotated[
    str | None, typer.Option("--who", help="recorded as the actor (default $ADAFLASH_USER / login)")
]
ReasonOpt = Annotated[str, typer.Option("--reason", help="why: recorded with the action and in the event")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


def _registry(target: str, tracking_uri: str, bootstrap_servers: str = ""):
    from adaflash.models.targets import load_vocabulary
    from adaflash.registry import RegistryClient

    vocab = load_vocabulary(target)  # the fingerprint without loading the weights
    return RegistryClient(
        tracking_uri,
        vocab.fingerprint,
        vocab.name,
        bootstrap_servers=bootstrap_servers or None,
        check_drafter=_drafter_check(target, vocab),
    )


def _drafter_check(target: str, vocab):
    """What a server's reload checks (`load_drafter_for`: config, every tensor, fingerprint,
    shapes), from the target's config alone — `registry register` refuses what servers would."""

    def check(d: Path) -> None:
        from adaflash.models.checkpoint import load_drafter

        hidden = layers = None
        if target == "tiny":
            from adaflash.models.targets import tiny_target

            c = tiny_target().config
            hidden, layers = c.hidden_size, c.num_layers
        else:
            from adaflash.models.targets import smollm2_dir

            cfg = (smollm2_dir() if target == "smollm2" else Path(target).expanduser()) / "config.json"
            if cfg.is_file():
                hf = json.loads(cfg.read_text())
                hidden, layers = hf.get("hidden_size"), hf.get("num_hidden_layers")
        load_drafter(
            d,
            target_fingerprint=vocab.fingerprint,
            target_vocab_size=vocab.vocab_size,
            target_hidden_size=hidden,
            target_num_layers=layers,
        )

    return check


def _registry_server(port: int, state_dir: Path | None):
    from adaflash.registry import RegistryServer

    return RegistryServer(state_dir or _home() / "mlflow", port=port)


def _version_json(info) -> dict:
    from dataclasses import asdict

    return asdict(info) | {"created_at": info.created_at.isoformat()}


@registry_server_app.command("start")
def registry_server_start(
    port: Annotated[int, typer.Option(help="loopback port")] = 5000,
    state_dir: Annotated[
        Path | None, typer.Option(help="store + artifacts (default $ADAFLASH_HOME/mlflow)")
    ] = None,
) -> None:
    """Start MLflow (if not running): 1 worker, no job runners, SQLite + local artifacts."""
    st = _registry_server(port, state_dir).start()
    console.print(
        f"MLflow running: pid {st.pid} at {st.tracking_uri} (store {st.backend_store}, log {st.log})"
    )


@registry_server_app.command("stop")
def registry_server_stop(
    port: Annotated[int, typer.Option()] = 5000, state_dir: Annotated[Path | None, typer.Option()] = None
) -> None:
    """Stop the MLflow server started by `adaflash registry server start`."""
    console.print(
        "MLflow stopped" if _registry_server(port, state_dir).stop() else "no MLflow server was running"
    )


@registry_server_app.command("status")
def registry_server_status(
    port: Annotated[int, typer.Option()] = 5000, state_dir: Annotated[Path | None, typer.Option()] = None
) -> None:
    """Show whether the MLflow server is up (process alive and /health OK)."""
    from dataclasses import asdict

    st = _registry_server(port, state_dir).status()
    console.print_json(json.dumps(asdict(st)))
    if not st.running:
        raise typer.Exit(1)


@registry_app.command("list")
def registry_list(
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    bootstrap_servers: EventsBootstrapOpt = "",
    as_json: JsonOpt = False,
) -> None:
    """Every drafter version of the target, newest first, with aliases, approval and shadow metrics."""
    reg = _registry(target, tracking_uri, bootstrap_servers)
    versions = reg.versions()
    if as_json:
        console.print_json(json.dumps([_version_json(v) for v in versions]))
        return
    t = Table(title=f"{reg.model_name} (target {reg.target_name})")
    for col in ("version", "aliases", "status", "approval", "registered", "records", "metrics", "code"):
        t.add_column(col)
    for v in versions:
        metrics = ", ".join(f"{k}={val}" for k, val in sorted(v.metrics.items()))
        t.add_row(
            v.version,
            ", ".join(v.aliases),
            v.status,
            v.approval or "",
            v.created_at.strftime("%Y-%m-%d %H:%M"),
            v.lineage.get("records", ""),
            metrics,
            (v.code_version or "")[:12],
        )
    console.print(t)


@registry_app.command("show")
def registry_show(
    version: Annotated[str, typer.Argument(help="version number or alias (champion, challenger, ...)")],
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    bootstrap_servers: EventsBootstrapOpt = "",
    as_json: JsonOpt = False,
) -> None:
    """One version: aliases, lineage, shadow metrics, code version, approvals and its action log."""
    info = _registry(target, tracking_uri, bootstrap_servers).show(version)
    if as_json:
        console.print_json(json.dumps(_version_json(info)))
        return
    t = Table(title=f"{info.model_name} v{info.version}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    for k, v in (
        ("aliases", ", ".join(info.aliases)),
        ("status", info.status),
        ("approval", info.approval or ""),
        ("registered", info.created_at.isoformat(timespec="seconds")),
        ("source", info.source),
        ("code version", info.code_version or ""),
    ):
        t.add_row(k, v)
    for k, v in sorted(info.lineage.items()):
        t.add_row(f"lineage.{k}", v)
    for k, v in sorted(info.metrics.items()):
        t.add_row(f"metric.{k}", v)
    t.add_row("actions", info.description)
    console.print(t)


@registry_app.command("approve")
def registry_approve(
    version: Annotated[str, typer.Argument(help="version number or alias")],
    reason: ReasonOpt,
    who: WhoOpt = None,
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    bootstrap_servers: EventsBootstrapOpt = "127.0.0.1:9092",
) -> None:
    """Approve a (pending) challenger and promote it to champion."""
    reg = _registry(target, tracking_uri, bootstrap_servers)
    v = reg.approve(version, who, reason)
    console.print(f"approved and promoted {reg.model_name} v{v} to champion")


@registry_app.command("register")
def registry_register(
    drafter: Annotated[Path, typer.Argument(help="drafter directory (e.g. the bootstrap drafter)")],
    reason: ReasonOpt,
    promote: Annotated[bool, typer.Option(help="make it the champion right away (the first one)")] = False,
    who: WhoOpt = None,
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    bootstrap_servers: EventsBootstrapOpt = "127.0.0.1:9092",
) -> None:
    """Register a drafter directory as a new version (challenger); --promote makes it champion."""
    reg = _registry(target, tracking_uri, bootstrap_servers)
    version = reg.register(drafter, lineage={"source": str(drafter)}, who=who, reason=reason)
    console.print(f"{reg.model_name} v{version} registered as challenger")
    if promote:
        reg.promote(version, who, reason)
        console.print(f"{reg.model_name} champion is now v{version}")


@registry_app.command("promote")
def registry_promote(
    version: Annotated[str, typer.Argument(help="version number or alias")],
    reason: ReasonOpt,
    who: WhoOpt = None,
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    bootstrap_servers: EventsBootstrapOpt = "127.0.0.1:9092",
) -> None:
    """Make a version champion; the old champion becomes previous_champion."""
    reg = _registry(target, tracking_uri, bootstrap_servers)
    ev = reg.promote(version, who, reason)
    old = f" (was v{ev.replaced_version})" if ev.replaced_version else ""
    console.print(f"{reg.model_name} champion is now v{ev.version}{old}")


@registry_app.command("rollback")
def registry_rollback(
    reason: ReasonOpt,
    who: WhoOpt = None,
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    bootstrap_servers: EventsBootstrapOpt = "127.0.0.1:9092",
) -> None:
    """Restore the previous champion; the demoted version is marked rolled_back."""
    reg = _registry(target, tracking_uri, bootstrap_servers)
    ev = reg.rollback(who, reason)
    console.print(
        f"rolled back {reg.model_name}: champion is v{ev.version} again (v{ev.replaced_version} rolled back)"
    )


@registry_app.command("pending")
def registry_pending(
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    as_json: JsonOpt = False,
) -> None:
    """Challengers waiting for a human approval."""
    pending = _registry(target, tracking_uri).pending_approvals()
    if as_json:
        console.print_json(json.dumps([_version_json(v) for v in pending]))
        return
    for v in pending:
        console.print(f"v{v.version}  {', '.join(v.aliases)}  metrics: {v.metrics}")
    if not pending:
        console.print("no version is pending approval")


@registry_app.command("sync")
def registry_sync(
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    bootstrap_servers: EventsBootstrapOpt = "127.0.0.1:9092",
) -> None:
    """Promote versions approved in the MLflow UI (tag adaflash.approval=approved)."""
    done = _registry(target, tracking_uri, bootstrap_servers).sync_ui_approvals()
    console.print(f"promoted v{', v'.join(done)}" if done else "no new approvals in the MLflow UI")


@registry_app.command("history")
def registry_history(
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    as_json: JsonOpt = False,
) -> None:
    """Every registry action, oldest first: who, when, why, and whether its event was published."""
    reg = _registry(target, tracking_uri)
    actions = reg.history()
    if as_json:
        from dataclasses import asdict

        console.print_json(json.dumps([asdict(a) | {"at": a.at.isoformat()} for a in actions]))
        return
    t = Table(title=f"{reg.model_name} history")
    for col in ("when (UTC)", "action", "version", "replaced", "who", "reason", "event"):
        t.add_column(col)
    for a in actions:
        t.add_row(
            a.at.strftime("%Y-%m-%d %H:%M:%S"),
            a.action,
            a.version,
            a.replaced_version or "",
            a.who,
            a.reason,
            "published" if a.event_published else "not published",
        )
    console.print(t)


@registry_app.command("download")
def registry_download(
    version: Annotated[str, typer.Argument(help="version number or alias")] = "champion",
    out: Annotated[
        Path | None, typer.Option(help="directory (default $ADAFLASH_HOME/registry/downloads/...)")
    ] = None,
    target: TargetOpt = "smollm2",
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
) -> None:
    """Fetch a version's drafter directory (DFlash format) for `adaflash serve --drafter`."""
    console.print(str(_registry(target, tracking_uri).download(version, out)))


# -- serving -----------------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _exit_when_engine_dies(engine) -> None:
    """A step loop that gave up (repeated failed steps) cannot recover in-process: exit non-zero so
    the supervisor (`adaflash up`, systemd, Kubernetes) restarts the server instead of leaving a
    process that answers /health 503 forever."""
    import threading

    def watch() -> None:
        engine._thread.join()
        if engine.failure is not None:
            err_console.print(f"error: the engine's step loop stopped: {engine.failure!r}; exiting")
            os._exit(70)  # EX_SOFTWARE

    threading.Thread(target=watch, name="engine-watchdog", daemon=True).start()


@app.command()
def serve(
    target: TargetOpt = "smollm2",
    drafter: Annotated[
        Path | None, typer.Option(help="drafter directory (DFlash format); none = ar only")
    ] = None,
    port: Annotated[int, typer.Option()] = 8000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    method: Annotated[str, typer.Option(help="default method: ar | dflash | adaflash")] = "adaflash",
    gamma: Annotated[float, typer.Option(help="k̂ = ⌊γ·â·k⌋")] = 1.0,
    max_running: Annotated[int, typer.Option(help="KV slots (requests decoding at once)")] = 32,
    max_queue: Annotated[int, typer.Option(help="waiting requests before HTTP 429")] = 64,
    max_model_len: Annotated[int, typer.Option(help="per-request prompt + max_tokens")] = 2048,
    step_token_budget: Annotated[int, typer.Option(help="verify tokens one step may pack")] = 1024,
    beta: Annotated[float, typer.Option(help="EMA weight of admission's N̂")] = 0.5,
    probe_every: Annotated[int, typer.Option(help="after k̂=1, skip the drafter for N-1 rounds")] = 1,
    bootstrap_servers: Annotated[
        str | None, typer.Option("--bootstrap-servers", help="Kafka for feedback records (none: no feedback)")
    ] = None,
    spool_dir: Annotated[Path, typer.Option(help="feedback spool while Kafka is unreachable")] = Path(
        ".adaflash/spool"
    ),
    model_name: Annotated[str, typer.Option(help="model id reported by the API")] = "adaflash",
    follow_registry: Annotated[
        str | None,
        typer.Option(
            help="MLflow URL: serve its champion and hot-reload on promotions/rollbacks (needs Kafka)"
        ),
    ] = None,
) -> None:
    """OpenAI-compatible server: /v1/completions, /v1/chat/completions, /health, /metrics, admin reload.

    The admin API (POST /admin/drafter/reload) takes `Authorization: Bearer $ADAFLASH_ADMIN_TOKEN`;
    without that variable it is disabled.
    """
    import uvicorn

    from adaflash.serving.engine import Engine, EngineConfig
    from adaflash.serving.reload import drafter_version
    from adaflash.serving.server import ServerSettings, create_app

    tgt, bundle = _load(target, drafter)
    if bundle is None and method != "ar":
        raise InputError(f"method {method!r} needs --drafter DIR (or use --method ar)")
    cfg = EngineConfig(
        method=method,
        gamma=gamma,
        max_running=max_running,
        max_queue=max_queue,
        max_model_len=max_model_len,
        step_token_budget=step_token_budget,
        beta=beta,
        probe_every=probe_every,
    )
    engine = Engine(tgt, bundle, cfg, drafter_version(bundle, drafter) if bundle else None)
    emitter = None
    if bootstrap_servers:
        from adaflash.feedback.producer import FeedbackProducer, ProducerConfig
        from adaflash.serving.feedback_emitter import FeedbackEmitter

        emitter = FeedbackEmitter(engine, FeedbackProducer(ProducerConfig(bootstrap_servers, spool_dir)))
    token = os.environ.get("ADAFLASH_ADMIN_TOKEN") or None
    app_ = create_app(
        engine,
        ServerSettings(model_name=model_name, admin_token=token),
        feedback=emitter.producer if emitter is not None else None,
    )
    engine.start()
    _exit_when_engine_dies(engine)
    follower = None
    if follow_registry:
        from adaflash.serving.champion_follower import ChampionFollower

        if not bootstrap_servers:
            raise InputError(
                "--follow-registry needs --bootstrap-servers (promotions arrive as Kafka events)"
            )
        follower = ChampionFollower(app_.state.reloader, bootstrap_servers, follow_registry, tgt.fingerprint)
        follower.start()  # subscribe first, so a promotion during the initial download is not missed
        live = follower.load_champion()
        err_console.print(f"following the champion at {follow_registry}: " + (live or "none yet"))
    err_console.print(
        f"serving {tgt.name} ({method}, drafter {engine.drafter_version}) on http://{host}:{port}"
        + ("" if token else " — admin API disabled (set ADAFLASH_ADMIN_TOKEN)")
    )
    try:
        uvicorn.run(app_, host=host, port=port, log_level="warning")
    finally:
        if follower is not None:
            follower.stop()
        engine.stop()
        if emitter is not None:
            emitter.close()


@app.command()
def bench(
    out: Annotated[Path, typer.Option(help="directory for results.json/.md and plots")],
    target: TargetOpt = "smollm2",
    drafter: Annotated[Path | None, typer.Option(help="drafter directory")] = None,
    methods: Annotated[str, typer.Option(help="comma-separated")] = "ar,dflash,adaflash",
    concurrency: Annotated[str, typer.Option(help="comma-separated client counts")] = "1,8,32",
    domains: Annotated[str, typer.Option(help="math,code,chat,blend")] = "math,code,chat,blend",
    max_new_tokens: Annotated[int, typer.Option()] = 64,
    prompts_per_cell: Annotated[int, typer.Option(help="0: max(C, --min-prompts)")] = 0,
    min_prompts: Annotated[int, typer.Option()] = 4,
    gamma: Annotated[float, typer.Option()] = 1.0,
    probe_every: Annotated[int, typer.Option(help="after k̂=1, skip the drafter for N-1 rounds")] = 1,
    hf_baseline: Annotated[bool, typer.Option(help="also time transformers.generate at equal batch")] = True,
    serve_rss: Annotated[
        int, typer.Option(help="also measure `serve`'s peak RSS at this concurrency (0: skip)")
    ] = 0,
    data_dir: Annotated[Path | None, typer.Option(help="prompt sets (default ../shared/data)")] = None,
) -> None:
    """Side-by-side serving benchmark: methods × concurrency × domains on one engine, one run."""
    from adaflash.serving.bench import BenchSpec, run_bench, serve_peak_rss, write_outputs

    spec = BenchSpec(
        methods=_csv(methods),
        concurrency=[int(c) for c in _csv(concurrency)],
        domains=_csv(domains),
        prompts_per_cell=prompts_per_cell,
        min_prompts=min_prompts,
        max_new_tokens=max_new_tokens,
        gamma=gamma,
        probe_every=probe_every,
        hf_baseline=hf_baseline,
        data_dir=data_dir,
    )
    if any(m != "ar" for m in spec.methods) and drafter is None:
        raise InputError("methods other than ar need --drafter DIR")
    tgt, bundle = _load(target, drafter)
    result = run_bench(tgt, bundle, spec, log=lambda s: err_console.print(s, markup=False, highlight=False))
    if serve_rss:
        from adaflash.workloads import interleave, load_prompts

        texts = [p.text for p in interleave(load_prompts("heldout", data_dir))][:serve_rss]
        log = lambda s: err_console.print(s, markup=False)  # noqa: E731
        result["serve_rss"] = serve_peak_rss(target, drafter, texts, serve_rss, max_new_tokens, log)
    for f in write_outputs(result, out):
        console.print(str(f))


@app.command()
def adapt(
    target: TargetOpt = "smollm2",
    drafter: Annotated[Path, typer.Option(help="the bootstrap drafter every learner starts from")] = Path(
        "drafters/smollm2"
    ),
    rounds: Annotated[int, typer.Option(help="rounds of shifted traffic")] = 6,
    per_round: Annotated[int, typer.Option(help="new prompts served per round")] = 16,
    concurrency: Annotated[int, typer.Option()] = 8,
    max_new_tokens: Annotated[int, typer.Option()] = 64,
    epochs: Annotated[int, typer.Option(help="online training epochs per round")] = 2,
    lr: Annotated[float, typer.Option()] = 3e-4,
    learners: Annotated[str, typer.Option(help="comma list of osd, adaflash")] = "osd,adaflash",
    source: Annotated[str, typer.Option(help="held-out prompt-id prefix of the new domain")] = "humaneval",
    out: Annotated[Path, typer.Option(help="JSON + markdown + plot")] = Path("benchmarks/online"),
    work: Annotated[Path, typer.Option(help="per-learner governance dirs and drafters")] = Path(
        ".adaflash/adapt"
    ),
) -> None:
    """Online adaptation experiment: OSD vs AdaFlash retraining on shifted traffic, DFlash fixed."""
    from adaflash.adaptation import LEARNERS, AdaptationSpec, run_adaptation, write_outputs

    names = [x.strip() for x in learners.split(",") if x.strip()]
    bad = [x for x in names if x not in LEARNERS]
    if bad:
        raise InputError(f"unknown learner(s) {', '.join(bad)}: choose from {', '.join(LEARNERS)}")
    spec = AdaptationSpec(rounds, per_round, concurrency, max_new_tokens, epochs, lr, names, source)
    tgt, _ = _load(target, None)
    result = run_adaptation(
        tgt, drafter, spec, work, log=lambda s: err_console.print(s, markup=False, highlight=False)
    )
    result["command"] = "adaflash adapt " + " ".join(sys.argv[2:])
    for f in write_outputs(result, out):
        console.print(str(f))


# -- continual-training pipeline ------------------------------------------------------------------------
pipeline_app = typer.Typer(
    no_args_is_help=True, help="The continual-training pipeline (Kubeflow Pipelines v2)."
)
app.add_typer(pipeline_app, name="pipeline")
PIPELINE_IR = Path("manifests/pipelines/continual_training.yaml")


@pipeline_app.command("compile")
def pipeline_compile(out: Annotated[Path, typer.Option(help="IR YAML to write")] = PIPELINE_IR) -> None:
    """Compile the pipeline to KFP IR YAML (committed; CI checks it for drift)."""
    from adaflash.pipelines.continual import compile_pipeline

    console.print(f"wrote {compile_pipeline(out)}")


@pipeline_app.command("run")
def pipeline_run(
    target: TargetOpt = "smollm2",
    fallback_drafter: Annotated[
        Path, typer.Option(help="champion to warm-start from until the registry has one")
    ] = Path("drafters/smollm2"),
    tracking_uri: Annotated[
        str, typer.Option(help="MLflow tracking/registry server")
    ] = "http://127.0.0.1:5000",
    bootstrap_servers: BootstrapOpt = "",
    data_dir: GovDirOpt = None,
    min_records: Annotated[int, typer.Option(help="new clean records a run needs")] = 128,
    loss: Annotated[str, typer.Option(help="opd | osd | fkl")] = "opd",
    epochs: Annotated[int, typer.Option()] = 2,
    gate_mode: Annotated[
        str, typer.Option(help="auto: promote a winner; manual: leave it pending approval")
    ] = "auto",
    min_gain: Annotated[float, typer.Option(help="required gain over the champion")] = 0.02,
    gate_metric: Annotated[
        str, typer.Option(help="tau_full (full-block τ; served τ guarded) | tau (served) | tps")
    ] = "tau_full",
    concurrency: Annotated[int, typer.Option(help="shadow-eval concurrency")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="shadow-eval output length")] = 64,
    pipeline_root: Annotated[Path, typer.Option(help="kfp.local artifacts")] = Path(".adaflash/kfp"),
) -> None:
    """Run the pipeline locally through kfp.local (every component in this environment)."""
    from adaflash.pipelines.continual import run_local

    gov = (data_dir or _home() / "governance").resolve()
    try:
        run_local(
            pipeline_root,
            target=target,
            governance_dir=str(gov),
            tracking_uri=tracking_uri,
            fallback_drafter=str(fallback_drafter.resolve()),
            bootstrap_servers=bootstrap_servers,
            min_records=min_records,
            loss=loss,
            epochs=epochs,
            gate_mode=gate_mode,
            gate_metric=gate_metric,
            min_gain=min_gain,
            concurrency=concurrency,
            max_new_tokens=max_new_tokens,
        )
    except ValueError as e:
        raise InputError(str(e)) from e
    console.print(f"pipeline finished; run log: {gov / 'pipeline_runs.jsonl'}")


@pipeline_app.command("schedule")
def pipeline_schedule(
    host: Annotated[str, typer.Option(help="Kubeflow Pipelines API endpoint (ml-pipeline-ui / ml-pipeline)")],
    target: Annotated[str, typer.Option(help="target as the pipeline pods see it")] = "/models/target",
    cron: Annotated[str, typer.Option(help="KFP cron with seconds field")] = "0 0 2 * * *",
    governance_dir: Annotated[
        str, typer.Option(help="governance dir as mounted in the cluster")
    ] = "/data/governance",
    tracking_uri: Annotated[str, typer.Option(help="MLflow as seen from the cluster")] = "http://mlflow:5000",
    fallback_drafter: Annotated[
        str, typer.Option(help="used until the registry has a champion")
    ] = "/data/governance/drafters/bootstrap",
    bootstrap_servers: BootstrapOpt = "kafka:9092",
    gate_mode: Annotated[str, typer.Option(help="auto | manual")] = "manual",
) -> None:
    """Create a recurring run of the committed IR on a Kubeflow cluster (kfp.Client)."""
    from adaflash.pipelines.schedule import schedule_recurring_run

    params = {
        "target": target,
        "governance_dir": governance_dir,
        "tracking_uri": tracking_uri,
        "fallback_drafter": fallback_drafter,
        "bootstrap_servers": bootstrap_servers,
        "gate_mode": gate_mode,
    }
    rid = schedule_recurring_run(host, params, cron=cron)
    console.print(f"recurring run {rid} created ({cron})")


@pipeline_app.command("watch")
def pipeline_watch(
    target: TargetOpt = "smollm2",
    data_dir: GovDirOpt = None,
    min_records: Annotated[int, typer.Option()] = 128,
    interval: Annotated[float, typer.Option(help="seconds between checks")] = 60.0,
    max_runs: Annotated[int | None, typer.Option(help="stop after this many runs")] = None,
    tracking_uri: Annotated[str, typer.Option()] = "http://127.0.0.1:5000",
    bootstrap_servers: BootstrapOpt = "",
    fallback_drafter: Annotated[Path, typer.Option()] = Path("drafters/smollm2"),
) -> None:
    """Run the pipeline locally whenever enough new clean records exist."""
    from adaflash.pipelines.schedule import watch

    gov = data_dir or _home() / "governance"

    def run() -> None:
        pipeline_run(
            target=target, fallback_drafter=fallback_drafter, tracking_uri=tracking_uri,
            bootstrap_servers=bootstrap_servers, data_dir=gov, min_records=min_records,
        )  # fmt: skip

    watch(gov, min_records, run, interval, max_runs, log=lambda m: print(m, flush=True))


# -- export + SGLang (issue 7) ----------------------------------------------------------------------------


@app.command("export")
def export(
    out: Annotated[Path, typer.Option("--out", help="directory to write (replaced atomically)")],
    version: Annotated[
        str | None, typer.Option("--version", help="registry version number or alias (champion, ...)")
    ] = None,
    from_dir: Annotated[
        Path | None, typer.Option("--from", help="a local drafter directory instead of the registry")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option("--target", "-t", help="the drafter's target (default smollm2 with --version)"),
    ] = None,
    tracking_uri: TrackingOpt = "http://127.0.0.1:5000",
    fmt: Annotated[str, typer.Option("--format", help="dflash (SGLang / vLLM)")] = "dflash",
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    require_block_size: Annotated[
        int | None,
        typer.Option(help="fail unless the drafter's block size is this (the server's K)"),
    ] = None,
) -> None:
    """Write a drafter directory SGLang/vLLM load unmodified (DFlash format, length head beside it)."""
    from adaflash.export import export_drafter, export_from_registry

    if fmt != "dflash":
        raise InputError(f"--format {fmt!r}: only dflash is supported")
    if (version is None) == (from_dir is None):
        raise InputError("give exactly one of --version V|champion (registry) or --from DIR (local)")
    if version is not None:
        done = export_from_registry(tracking_uri, target or "smollm2", version, out, dtype=dtype,
                                    require_block_size=require_block_size)  # fmt: skip
    else:
        fit = {}
        if target is not None:
            from adaflash.models.targets import load_vocabulary

            vocab = load_vocabulary(target)
            fit = {"target_fingerprint": vocab.fingerprint, "target_vocab_size": vocab.vocab_size}
        done = export_drafter(from_dir, out, dtype=dtype, require_block_size=require_block_size, **fit)
    where = f"v{done.version}" if done.version else "local drafter"
    print(f"exported {where} to {done.path} (block size {done.block_size}, {done.num_layers} layers)")


sglang_app = typer.Typer(no_args_is_help=True, help="Serve exported drafters with SGLang (GPU fleet).")
app.add_typer(sglang_app, name="sglang")


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
    from adaflash.export import drafter_block_size, sglang_launch_argv, shell_line, target_model_path
    from adaflash.models.targets import load_vocabulary

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


# -- the embedded stack ---------------------------------------------------------------------------------
def _stack(target: str, drafter: Path | None, broker_port: int, registry_port: int, port: int, watch: bool,
           min_records: int):  # fmt: skip
    from adaflash.stack import Stack, StackConfig

    return Stack(
        StackConfig(
            home=_home().resolve(),
            target=target,
            drafter=drafter.resolve() if drafter else None,
            broker_port=broker_port,
            registry_port=registry_port,
            serve_port=port,
            watch=watch,
            min_records=min_records,
        )  # fmt: skip
    )


BrokerPortOpt = Annotated[int, typer.Option(help="Kafka (Tansu) port")]
RegistryPortOpt = Annotated[int, typer.Option(help="MLflow port")]
ServePortOpt = Annotated[int, typer.Option(help="OpenAI API port")]


def _print_stack(rows: list[dict]) -> None:
    t = Table(title=f"AdaFlash stack — {_home()}")
    for col in ("service", "running", "pid", "where"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r["service"], "[green]up[/]" if r["running"] else "[red]down[/]", str(r["pid"] or "-"), r["where"]
        )
    console.print(t)


@app.command()
def up(
    target: TargetOpt = "smollm2",
    drafter: Annotated[
        Path | None, typer.Option(help="bootstrap drafter, served until a champion exists")
    ] = Path("drafters/smollm2"),
    broker_port: BrokerPortOpt = 9092,
    registry_port: RegistryPortOpt = 5000,
    port: ServePortOpt = 8000,
    watch: Annotated[bool, typer.Option(help="start the pipeline watcher")] = True,
    min_records: Annotated[int, typer.Option(help="new clean records that trigger a pipeline run")] = 128,
) -> None:
    """Start the embedded stack: broker, MLflow, serving engine, governance, pipeline watcher."""
    if drafter is not None and not (drafter / "config.json").exists():
        raise InputError(f"no drafter at {drafter}: run `make bootstrap` or pass --drafter DIR")
    stack = _stack(target, drafter, broker_port, registry_port, port, watch, min_records)
    with err_console.status("starting") as st:
        stack.up(progress=lambda name: st.update(f"starting {name}..."))
    _print_stack(stack.status())


@app.command()
def down(
    broker_port: BrokerPortOpt = 9092,
    registry_port: RegistryPortOpt = 5000,
    port: ServePortOpt = 8000,
) -> None:
    """Stop everything `adaflash up` started."""
    stopped = _stack("smollm2", None, broker_port, registry_port, port, True, 128).down()
    console.print("stopped: " + (", ".join(stopped) or "nothing was running"))


@app.command()
def status(
    broker_port: BrokerPortOpt = 9092,
    registry_port: RegistryPortOpt = 5000,
    port: ServePortOpt = 8000,
) -> None:
    """One view of the embedded stack's services."""
    rows = _stack("smollm2", None, broker_port, registry_port, port, True, 128).status()
    _print_stack(rows)
    if not all(r["running"] for r in rows):
        raise typer.Exit(1)


@app.command()
def gateway(
    upstream: Annotated[str, typer.Option(help="OpenAI-compatible backend (SGLang, vLLM, adaflash serve)")],
    api_keys: Annotated[Path, typer.Option(help="JSON file {api_key: tenant_id}")],
    target: TargetOpt = "smollm2",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8080,
    bootstrap_servers: BootstrapOpt = "127.0.0.1:9092",
    spool_dir: Annotated[Path, typer.Option(help="feedback spool while Kafka is unreachable")] = Path(
        ".adaflash/gateway-spool"
    ),
    drafter_version: Annotated[
        str | None, typer.Option(help="what the fleet serves, if it does not say")
    ] = None,
    method: Annotated[
        str, typer.Option(help="what the fleet runs: dflash (SGLang) | adaflash | ar")
    ] = "dflash",
    block_size: Annotated[int, typer.Option(help="the fleet's drafter block size")] = 16,
) -> None:
    """Feedback gateway: proxy an OpenAI-compatible fleet unchanged and emit one record per request."""
    import uvicorn

    from adaflash.feedback.producer import FeedbackProducer, ProducerConfig
    from adaflash.models.targets import load_vocabulary
    from adaflash.serving.gateway import GatewaySettings, create_gateway

    try:
        keys = json.loads(api_keys.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read API keys from {api_keys}: {e}") from None
    if not isinstance(keys, dict) or not keys:
        raise InputError(f"{api_keys} must hold a non-empty JSON object {{api_key: tenant_id}}")
    producer = FeedbackProducer(ProducerConfig(bootstrap_servers, spool_dir))
    settings = GatewaySettings(upstream, keys, drafter_version, method, block_size)
    app_ = create_gateway(settings, load_vocabulary(target), producer.send)
    err_console.print(f"gateway for {upstream} on http://{host}:{port} ({len(keys)} API keys)")
    try:
        uvicorn.run(app_, host=host, port=port, log_level="warning")
    finally:
        producer.close()


fleet_app = typer.Typer(no_args_is_help=True, help="The fleet controller: make the champion live everywhere.")
app.add_typer(fleet_app, name="fleet")


@fleet_app.command("run")
def fleet_run(
    config: Annotated[Path, typer.Option(help="fleet YAML (see manifests/base/fleet-controller.yaml)")],
    health_port: Annotated[int, typer.Option(help="GET /healthz for probes")] = 8081,
) -> None:
    """Follow adaflash.drafter.events; reload engines / roll SGLang on every champion change."""
    import time

    from adaflash.models.targets import load_vocabulary
    from adaflash.serving.champion_follower import ChampionFollower
    from adaflash.serving.fleet import FleetConfig, FleetController, serve_health

    cfg = FleetConfig.load(config)
    fingerprint = load_vocabulary(cfg.target).fingerprint
    controller = FleetController(cfg, fingerprint)
    serve_health(health_port, controller)
    follower = ChampionFollower(
        None, cfg.bootstrap_servers, cfg.tracking_uri, fingerprint, apply=controller.apply
    )
    follower.start()
    err_console.print(f"fleet controller: {len(cfg.backends)} backend(s), health on :{health_port}")
    try:
        while True:
            time.sleep(3600)
    finally:
        follower.stop()


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # returns typer.Exit's code instead of exiting
    except AdaFlashError as e:
        print(f"error: {e}", file=sys.stderr)  # one line, never wrapped
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("aborted")
        sys.exit(130)
    except Exception as e:  # click's usage errors arrive here in non-standalone mode
        # (typer vendors its own click: match its exceptions by shape, not by class)
        fmt, code = getattr(e, "format_message", None), getattr(e, "exit_code", None)
        if callable(fmt) and isinstance(code, int):
            ctx = getattr(e, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None and getattr(ctx, "command_path", "") else ""
            print(f"error: {where}{' '.join(fmt().split())}", file=sys.stderr)  # one line
            sys.exit(2 if code in (1, 2) else code)
        raise
    if isinstance(rc, int) and rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
