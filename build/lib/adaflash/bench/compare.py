"""`adaflash compare`: ar vs dflash vs adaflash on held-out prompts, one engine, one run."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.targets import Target
from adaflash.serving.offline import METHODS, DecodeConfig, OfflineDecoder
from adaflash.workloads import DOMAINS, load_prompts


def run_comparison(
    target: Target,
    bundle: DrafterBundle,
    per_domain: int,
    max_new_tokens: int,
    console: Console,
    out_json: Path = Path(".cache/demo-results.json"),
) -> dict:
    held = load_prompts("heldout")
    # Prompts past the bootstrap's evaluation set: still held-out, and not looked at before.
    prompts = [(d, p) for d in DOMAINS for p in held[d][-per_domain:]]
    decoder = OfflineDecoder(target, bundle)
    rows: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for method in METHODS:
        seconds = tokens = 0.0
        rounds = taus = verify = 0.0
        by_domain: dict[str, list[float]] = {d: [] for d in DOMAINS}
        outputs[method] = []
        with console.status(f"running {method} on {len(prompts)} held-out prompts..."):
            for dom, p in prompts:
                ids = target.tokenizer.chat_prompt(p.text)
                r = decoder.generate([ids], DecodeConfig(method, max_new_tokens))[0]
                outputs[method].append(r.token_ids)
                seconds += r.seconds
                tokens += len(r.token_ids)
                rounds += len(r.rounds)
                taus += sum(x.accepted + 1 for x in r.rounds)
                verify += sum(x.verify_len for x in r.rounds)
                by_domain[dom].append(r.tau)
        rows[method] = {
            "tokens_per_second": tokens / seconds,
            "tau": taus / rounds,
            "mean_verify_len": verify / rounds,
            "tau_by_domain": {d: sum(v) / len(v) for d, v in by_domain.items() if v},
            "identical_to_ar": sum(a == b for a, b in zip(outputs[method], outputs["ar"], strict=True)),
        }
    ar_tps = rows["ar"]["tokens_per_second"]
    table = Table(
        title=f"{target.name}: {len(prompts)} held-out prompts, greedy, batch 1, "
        f"max {max_new_tokens} new tokens"
    )
    for col in ("method", "tok/s", "speedup", "τ", "mean k̂", "τ math/code/chat", "= AR output"):
        table.add_column(col, justify="right")
    for m, r in rows.items():
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar_tps
        dom = "/".join(f"{r['tau_by_domain'].get(d, float('nan')):.2f}" for d in DOMAINS)
        table.add_row(
            m,
            f"{r['tokens_per_second']:.1f}",
            f"{r['speedup_vs_ar']:.2f}x",
            f"{r['tau']:.2f}",
            f"{r['mean_verify_len']:.2f}",
            dom,
            f"{r['identical_to_ar']}/{len(prompts)}",
        )
    console.print(table)
    ex_dom, ex = prompts[0]
    console.print(f"[bold]example ({ex_dom})[/]: {ex.text[:120]}")
    console.print(target.tokenizer.decode(outputs["adaflash"][0]), markup=False, highlight=False)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(
        json.dumps({"target": target.name, "drafter": str(bundle.path), "methods": rows}, indent=2)
    )
    console.print(f"results: {out_json}")
    return rows
