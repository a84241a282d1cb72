"""`adaflash drafter ...` (bootstrap, corpus, release, info) and `adaflash export`: make a drafter,
look inside one, and write one out in the format SGLang/vLLM load."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from adaflash.cli._common import PromptsDirOpt, TargetOpt, TrackingOpt, console, load
from adaflash.errors import InputError

app = typer.Typer()
drafter_app = typer.Typer(no_args_is_help=True, help="Create and inspect drafters.")
app.add_typer(drafter_app, name="drafter")


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
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--no-bf16",
            help="bf16 autocast in training steps [default: if the device has native bf16]",
        ),
    ] = None,
    init_from_target: Annotated[bool, typer.Option(help="start from the target's top layers")] = False,
    init_from: Annotated[
        Path | None, typer.Option(help="warm-start from this drafter directory (a new --out only)")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="response length cap of the training data")] = 256,
    max_train_prompts: Annotated[int | None, typer.Option(help="use only the first N train prompts")] = None,
    generate: Annotated[bool, typer.Option(help="generate responses the committed corpus lacks")] = True,
    refresh_every: Annotated[
        int, typer.Option(help="every N steps, train also on responses newly in the cache (0: off)")
    ] = 0,
    eval_per_domain: Annotated[int, typer.Option(help="held-out prompts per domain for τ")] = 40,
    data_dir: PromptsDirOpt = None,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Train the offline "DFlash" drafter + length head on the target's own greedy responses.

    Responses come from the committed corpus (data/responses/) and the cache; missing ones are
    generated. Features are stored once; steps never run the target. Resumable: rerun the same
    command to continue."""
    from adaflash.cli.progress import BootstrapProgress
    from adaflash.training.bootstrap import BootstrapConfig, BootstrapTrainer

    if steps < 0:
        raise InputError("--steps must be >= 0")
    if budget_minutes is not None and budget_minutes <= 0:
        raise InputError("--budget-minutes must be > 0")
    tgt, _ = load(target, None)
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
        init_from=str(init_from) if init_from is not None else None,
        max_new_tokens=max_new_tokens,
        max_train_prompts=max_train_prompts,
        generate_missing=generate,
        refresh_every_steps=refresh_every,
        eval_per_domain=eval_per_domain,
        seed=seed,
    )
    with BootstrapProgress() as on:
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
    from adaflash.training.release import release

    tgt, _ = load(target, None)
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
    fmt: Annotated[
        str, typer.Option("--format", help="dflash (SGLang) | vllm (adds vLLM's draft-vocabulary head)")
    ] = "dflash",
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    require_block_size: Annotated[
        int | None,
        typer.Option(help="fail unless the drafter's block size is this (the server's K)"),
    ] = None,
) -> None:
    """Write a drafter directory SGLang/vLLM load unmodified (DFlash format, length head beside it)."""
    from adaflash.serving.export import export_drafter, export_from_registry

    if (version is None) == (from_dir is None):
        raise InputError("give exactly one of --version V|champion (registry) or --from DIR (local)")
    if version is not None:
        done = export_from_registry(tracking_uri, target or "smollm2", version, out, dtype=dtype,
                                    require_block_size=require_block_size, fmt=fmt)  # fmt: skip
    else:
        fit = {}
        if target is not None:
            from adaflash.models.targets import load_vocabulary
            from adaflash.serving.export import target_dir_or_none

            vocab = load_vocabulary(target)
            fit = {"target_fingerprint": vocab.fingerprint, "target_vocab_size": vocab.vocab_size,
                   "target_dir": target_dir_or_none(target)}  # fmt: skip
        done = export_drafter(
            from_dir, out, dtype=dtype, require_block_size=require_block_size, fmt=fmt, **fit
        )
    where = f"v{done.version}" if done.version else "local drafter"
    print(f"exported {where} to {done.path} (block size {done.block_size}, {done.num_layers} layers)")
